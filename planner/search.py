"""Search: enumerate deployments, fit memory, screen analytically, simulate the best, rank."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.calibrate import Calibration
from planner.catalog import Catalog, Model
from planner.checkpoints import servable
from planner.cost import (
    CostOptions,
    autoscaled_cost,
    cost_per_hour,
    cost_per_million,
    hourly_replicas,
)
from planner.evaluate import check_context, token_prices
from planner.memory import MemoryPlan
from planner.replica import memory_for, replica_for
from planner.screen import capacity, estimate
from planner.simulate import simulate
from planner.timing import Deployment, SpecDecode, StepCost, cp_problem, dcp_problem
from planner.workload import Workload

Progress = Callable[[float, str], None]


class Cancelled(Exception):
    """The caller's cancel() returned True between candidates."""


# The screen's steady state is a mean where the SLOs are p99s, and simulation confirms every plan
# it passes: a candidate whose estimate lands within this factor of an SLO is simulated rather
# than dropped (a single DeepSeek-V3 replica at 128K estimated TPOT 100.2 ms, simulated p99 93 ms,
# against a 100 ms SLO).
SCREEN_SLACK = 1.1
# Prompts shorter than this are not split by context parallelism in the search: each CP rank
# adds a whole TP group's cost to buy TTFT, worth it where a prompt's prefill is seconds long
# (a 128K prompt on a TP8 node: 6-12 s), and the search's candidates stay fewer. A shorter
# prompt against a tighter TTFT target can still be planned with CP by `plan evaluate --cp`.
CP_MIN_PROMPT = 8192


@dataclass(frozen=True)
class SearchSpace:
    """The options to combine; every combination is one candidate."""

    gpus: tuple[str, ...] = ()
    weights: tuple[str, ...] = ("bf16", "fp8", "int8", "int4")
    kv: tuple[str, ...] = ("bf16", "fp8")
    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4)
    max_seqs: tuple[int, ...] = (16, 32, 64, 128, 256)
    spec: tuple[SpecDecode | None, ...] = (None, SpecDecode())
    # Decode context parallel sizes; only those vLLM accepts for the model and TP are tried
    # (planner.timing.dcp_problem): for GQA models within one node that is rarely any.
    dcp: tuple[int, ...] = (1, 2, 4, 8)
    # Prefill context parallel ranks, tried for long prompts only (CP_MIN_PROMPT); over nodes
    # only on GPUs the catalog gives a network between them.
    cp: tuple[int, ...] = (1, 2, 4)
    max_batched_tokens: int = 2048
    prefix_hit: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A ranked option: layout, replicas, predicted p99 latencies and cost."""

    deployment: Deployment
    replicas: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    throughput_tok_s: float
    cost_per_hour: float
    cost_per_1m_tokens: float
    memory: MemoryPlan
    simulated: bool
    calibration: str
    folded: int = 0  # plans of the same shape with another batch limit, folded into this one
    # The hour's cost split between prompts and generated tokens by their share of GPU time
    # (planner.screen.input_time_share), each over its own tokens.
    cost_per_1m_input: float = math.nan
    cost_per_1m_output: float = math.nan

    def as_dict(self) -> dict:
        d = self.deployment
        return {"gpu": d.gpu.name, "tp": d.tp, "pp": d.pp, "replicas": self.replicas,
                "gpus": d.gpus * self.replicas, "weights": d.weights, "kv": d.kv,
                "max_seqs": d.max_seqs, "dcp": d.dcp, "cp": d.cp, "layout": d.layout,
                "spec_decode": None if d.spec is None else {
                    "method": d.spec.method, "draft_len": d.spec.draft_len,
                    "acceptance": d.spec.acceptance, "draft": d.spec.draft or None,
                    "tokens_per_step": round(d.spec.tokens_per_step, 3),
                    "measured_on": d.spec.measured_on or None},
                "ttft_p99_ms": round(self.ttft_p99_ms, 3),
                "tpot_p99_ms": round(self.tpot_p99_ms, 3),
                "e2e_p99_ms": round(self.e2e_p99_ms, 3),
                "throughput_tok_s": round(self.throughput_tok_s, 2),
                "cost_per_hour": round(self.cost_per_hour, 4),
                "cost_per_1m_tokens": round(self.cost_per_1m_tokens, 4),
                "cost_per_1m_input_tokens": round(self.cost_per_1m_input, 4),
                "cost_per_1m_output_tokens": round(self.cost_per_1m_output, 4),
                "memory_gb_per_gpu": round(self.memory.total_gb, 3),
                "simulated": self.simulated, "calibration": self.calibration,
                "folded_variants": self.folded}


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans meeting every constraint, their Pareto front, and what was looked at."""

    candidates: list[Plan]
    pareto: list[Plan]
    evaluated: int
    fitting: int
    screened: int
    simulated: int
    seconds: float
    infeasible: str = ""
    notes: list[str] = field(default_factory=list)
    folded: int = 0
    # Why the best plan spreads over nodes where it does (cp_reason); "" otherwise.
    why_layout: str = ""


def enumerate_deployments(model: Model, catalog: Catalog, space: SearchSpace,
                          long_prompts: bool = False) -> list[Deployment]:
    """Every combination in the space that is a valid layout (heads split evenly over TP);
    prefill context parallelism only for `long_prompts` (CP_MIN_PROMPT tokens or more)."""
    gpus = [catalog.gpu(n) for n in space.gpus] if space.gpus else list(catalog.gpus.values())
    cps = space.cp if long_prompts else (1,)
    out = []
    for gpu, w, kv, tp, pp, seqs, spec, dcp, cp in itertools.product(
            gpus, space.weights, space.kv, space.tp, space.pp, space.max_seqs, space.spec,
            space.dcp, cps):
        if model.heads % tp or pp > model.layers or dcp_problem(model, tp, dcp):
            continue
        if cp_problem(gpu, tp * pp, cp, dcp):
            continue
        if gpu.interconnect == "none" and tp * pp * dcp > 1:  # one machine's CPU: no peers
            continue
        out.append(Deployment(model, gpu, w, kv, tp, pp, seqs, space.max_batched_tokens, spec,
                              space.prefix_hit, dcp, cp=cp))
    return out


def servable_only(deployments: list[Deployment]) -> tuple[list[Deployment], dict[str, int]]:
    """The deployments vLLM can run (drafts resolved), and how many were dropped for each
    reason (a quantized checkpoint or a draft model nobody publishes, spec decode with PP)."""
    kept, dropped = [], {}
    for d in deployments:
        ok = servable(d)
        if isinstance(ok, str):
            dropped[ok] = dropped.get(ok, 0) + 1
        else:
            kept.append(ok)
    return kept, dropped


@dataclass
class _Screened:
    deployment: Deployment
    memory: MemoryPlan
    replicas: int
    cost: float
    e2e: float  # the analytic estimate of a request's end-to-end seconds


def shape(d: Deployment) -> tuple:
    """A deployment without its batch limit: plans differing only in max_seqs share it."""
    return d.gpu.name, d.weights, d.kv, d.tp, d.pp, d.spec, d.dcp, d.cp


class _Screen:
    """Memory fit and analytic replica count per candidate. Candidates differing only in their
    batch limit share a step-cost model and the steady states computed for each replica count."""

    def __init__(self, w: Workload, calibration: Calibration, opts: CostOptions) -> None:
        self.w, self.calibration, self.opts = w, calibration, opts
        self.memory: dict[tuple, MemoryPlan] = {}
        self.costs: dict[tuple, tuple[StepCost, int, float]] = {}
        self.states: dict[tuple, tuple[float, float, float] | None] = {}
        self.best_tpot = float("inf")
        self.best_ttft = float("inf")
        self.over_budget = float("inf")

    def memory_of(self, d: Deployment) -> MemoryPlan:
        key = (d.gpu.name, d.weights, d.kv, d.tp, d.pp, d.dcp)
        if key not in self.memory:
            self.memory[key] = memory_for(d, self.w)
        return self.memory[key]

    def _group(self, d: Deployment, memory: MemoryPlan) -> tuple[tuple, StepCost, int, float]:
        key = shape(d)
        if key not in self.costs:
            cost = StepCost(replace(d, max_seqs=memory.max_sequences),
                            self.calibration.efficiency(d.gpu.name, d.weights))
            light = estimate(cost, self.w.rate / 1e3, self.w, memory.max_sequences)
            if light is not None:
                self.best_ttft = min(self.best_ttft, light[0])
                self.best_tpot = min(self.best_tpot, light[1])
            start = max(1, math.ceil(self.w.rate / max(capacity(cost, self.w,
                                                                memory.max_sequences), 1e-9)))
            self.costs[key] = (cost, start, light[1] if light else math.inf)
        cost, start, tpot_light = self.costs[key]
        return key, cost, start, tpot_light

    def _state(self, key: tuple, cost: StepCost, replicas: int, b_mem: int):
        if (key, replicas) not in self.states:
            self.states[key, replicas] = estimate(cost, self.w.rate / replicas, self.w, b_mem)
        return self.states[key, replicas]

    def __call__(self, d: Deployment, memory: MemoryPlan) -> _Screened | None:
        w, slo = self.w, self.w.slo
        key, cost, start, tpot_light = self._group(d, memory)
        b_max = min(d.max_seqs, memory.max_sequences)
        # Little's law bounds the replicas from below: each holds at most b_max sequences.
        start = max(start, math.ceil(w.rate * w.output_len * tpot_light / b_max - 1e-9))
        for replicas in range(start, start + 8):
            est = self._state(key, cost, replicas, memory.max_sequences)
            if (est is not None and est[2] <= b_max * 1.02
                    and est[0] * 1e3 <= slo.ttft_p99_ms * SCREEN_SLACK
                    and est[1] * 1e3 <= slo.tpot_p99_ms * SCREEN_SLACK):
                e2e = est[0] + est[1] * max(w.output_len - 1, 0)
                return _Screened(d, memory, replicas, self.hourly(d, cost, b_max, replicas), e2e)
        return None

    def hourly(self, d: Deployment, cost: StepCost, b_max: int, replicas: int) -> float:
        if not (self.opts.autoscale and self.w.daily_profile):
            return cost_per_hour(d.gpu, d.gpus, replicas, self.opts)
        per_replica = min(capacity(cost, self.w, b_max), self.w.rate / replicas)
        hours = hourly_replicas(replicas, self.w.rate, self.w.daily_profile, per_replica)
        return autoscaled_cost(d.gpu, d.gpus, hours, self.opts)


def _confirm(s: _Screened, w: Workload, calibration: Calibration, opts: CostOptions,
             extra_replicas: int = 3) -> Plan | None:
    """Simulate a screened candidate; add replicas until the simulated p99s meet the SLOs."""
    replica = replica_for(s.deployment, s.memory, calibration)
    for replicas in range(s.replicas, s.replicas + extra_replicas + 1):
        result = simulate(replica, w, replicas)
        ttft, tpot = result.summary("ttft"), result.summary("tpot")
        if ttft["p99"] <= w.slo.ttft_p99_ms and tpot["p99"] <= w.slo.tpot_p99_ms:
            hourly = s.cost * replicas / s.replicas
            served = w.rate * w.output_len
            inp, out = token_prices(s.deployment, w, replicas, s.memory, calibration, hourly)
            return Plan(s.deployment, replicas, ttft["p99"], tpot["p99"],
                        result.summary("e2e")["p99"], result.throughput_tok_s, hourly,
                        cost_per_million(hourly, served), s.memory, True, calibration.name,
                        cost_per_1m_input=inp, cost_per_1m_output=out)
    return None


def _front(items: list, cost: Callable, latency: Callable) -> list:
    """Items no other item beats on both cost and latency, cheapest first."""
    front: list = []
    for item in sorted(items, key=lambda i: (cost(i), latency(i))):
        if not front or latency(item) < latency(front[-1]):
            front.append(item)
    return front


def pareto_front(plans: list[Plan]) -> list[Plan]:
    """Plans no other plan beats on both $/hour and p99 end-to-end latency."""
    return _front(plans, lambda p: p.cost_per_hour, lambda p: p.e2e_p99_ms)


def fold_batch_limits(plans: list[Plan]) -> tuple[list[Plan], int]:
    """Keep the first (best-ranked) plan of each shape; the others differ only in max_seqs.
    Returns the kept plans, each counting what it absorbed, and how many were folded."""
    kept: dict[tuple, Plan] = {}
    for p in plans:
        key = shape(p.deployment)
        if key in kept:
            kept[key] = replace(kept[key], folded=kept[key].folded + 1)
        else:
            kept[key] = p
    out = list(kept.values())
    return out, len(plans) - len(out)


def search(model: Model, w: Workload, catalog: Catalog, space: SearchSpace | None = None,
           budget_per_hour: float | None = None, calibration: Calibration | None = None,
           cost_opts: CostOptions | None = None, simulate_cheapest: int = 16,
           progress: Progress | None = None,
           cancel: Callable[[], bool] | None = None) -> SearchResult:
    """Rank deployments of `model` serving open-loop workload `w` within its SLOs and budget."""
    if w.rate is None:
        raise ValueError("search needs a workload with a request rate")
    check_context(model, w)
    started = time.perf_counter()
    space, calibration = space or SearchSpace(), calibration or Calibration()
    opts = cost_opts or CostOptions()
    enumerated = enumerate_deployments(model, catalog, space, w.input_len >= CP_MIN_PROMPT)
    deployments, unservable = servable_only(enumerated)
    screen = _Screen(w, calibration, opts)
    fitting, passed = 0, []
    for n, d in enumerate(deployments):
        if cancel is not None and n % 256 == 0 and cancel():
            raise Cancelled("search cancelled")
        if progress is not None and n % 1024 == 0:
            progress(0.6 * n / max(1, len(deployments)), f"screening {n}/{len(deployments)}")
        memory = screen.memory_of(d)
        if not memory.fits:
            continue
        fitting += 1
        screened = screen(d, memory)
        if screened is None:
            continue
        if budget_per_hour is None or screened.cost <= budget_per_hour:
            passed.append(screened)
        else:
            screen.over_budget = min(screen.over_budget, screened.cost)
    chosen = to_simulate(passed, simulate_cheapest)
    plans = _simulate(chosen, w, calibration, opts, progress, cancel)
    if budget_per_hour is not None:
        plans = [p for p in plans if p.cost_per_hour <= budget_per_hour]
    plans.sort(key=lambda p: (p.cost_per_hour, p.e2e_p99_ms))
    # The front keeps every simulated trade-off (a smaller batch limit can buy latency with
    # money); the ranking shows one row per shape.
    front = pareto_front(plans)
    ranked, folded = fold_batch_limits(plans)
    why = "" if plans else explain(model, w, catalog, space, screen, passed, fitting,
                                   budget_per_hour)
    notes = [f"{folded} plan(s) differing only in the batch limit folded into the best of "
             f"their shape"] if folded else []
    notes += [f"{n} candidate(s) not offered: {reason}" for reason, n in unservable.items()]
    if not deployments and unservable:
        why = why or "no candidate can run as configured: " + "; ".join(unservable)
    why_layout = cp_reason(ranked[0], w, calibration) if ranked else ""
    return SearchResult(ranked, front, len(enumerated), fitting, len(passed), len(chosen),
                        time.perf_counter() - started, why, notes, folded, why_layout)


def cp_reason(plan: Plan, w: Workload, calibration: Calibration) -> str:
    """Why a plan splits each prompt over nodes: one TP group's prefill of the workload's
    prompt alone against the split one, beside the TTFT SLO ("" for a plan without CP)."""
    d = plan.deployment
    if d.cp == 1:
        return ""
    eff = calibration.efficiency(d.gpu.name, d.weights)
    alone = StepCost(replace(d, cp=1), eff).prefill_seconds(w.input_len)
    split = StepCost(d, eff).prefill_seconds(w.input_len)
    group = replace(d, cp=1).layout
    where = f"{d.nodes} nodes" if d.nodes > 1 else "one node"
    # prefill_seconds computes only what the prefix cache does not hold: say so.
    uncached = w.input_len - int(w.input_len * d.prefix_hit)
    what = (f"a {w.input_len}-token prompt" if uncached == w.input_len
            else f"the {uncached} uncached tokens of a {w.input_len}-token prompt")
    return (f"context parallelism: one {group} group prefills {what} in "
            f"{alone:.1f} s, {d.cp} of them ({d.gpus} GPUs, {where}) in {split:.1f} s, "
            f"against a TTFT p99 target of {w.slo.ttft_p99_ms / 1e3:g} s")


def to_simulate(passed: list[_Screened], cheapest: int) -> list[_Screened]:
    """What to simulate: the screened Pareto set (cost against estimated end-to-end latency),
    so the simulated front spans the trade-off, plus the cheapest variant of each of the
    `cheapest` cheapest shapes, so the top of the ranking is confirmed by simulation."""
    chosen = {id(s): s for s in _front(passed, lambda s: s.cost, lambda s: s.e2e)}
    shapes: set[tuple] = set()
    for s in sorted(passed, key=lambda s: (s.cost, s.e2e)):
        if len(shapes) >= cheapest:
            break
        if shape(s.deployment) not in shapes:
            shapes.add(shape(s.deployment))
            chosen.setdefault(id(s), s)
    return sorted(chosen.values(), key=lambda s: (s.cost, s.e2e))


def _simulate(chosen: list[_Screened], w: Workload, calibration: Calibration,
              opts: CostOptions, progress: Progress | None,
              cancel: Callable[[], bool] | None) -> list[Plan]:
    plans = []
    for i, s in enumerate(chosen):
        if cancel is not None and cancel():
            raise Cancelled("search cancelled")
        if progress is not None:
            progress(0.6 + 0.4 * i / max(1, len(chosen)), f"simulating {i + 1}/{len(chosen)}")
        plan = _confirm(s, w, calibration, opts)
        if plan is not None:
            plans.append(plan)
    return plans


def explain(model: Model, w: Workload, catalog: Catalog, space: SearchSpace, screen: _Screen,
            passed: list, fitting: int, budget: float | None) -> str:
    """Why nothing qualified, and the nearest relaxation that would."""
    if fitting == 0:
        return _memory_relaxation(model, w, catalog, space, screen)
    if budget is not None and screen.over_budget < float("inf"):
        return (f"no plan meets the SLOs within ${budget:.2f}/hour; the cheapest meeting them "
                f"costs ${screen.over_budget:.2f}/hour (raise the budget to that)")
    if passed:
        return ("options pass the analytic screen but none meets the p99 SLOs in simulation "
                "with up to 3 extra replicas; relax the SLOs by about 20%")
    return (f"no option meets the SLOs: the lowest TTFT any option reaches is "
            f"{screen.best_ttft * 1e3:.0f} ms (SLO {w.slo.ttft_p99_ms:g} ms) and the lowest "
            f"TPOT is {screen.best_tpot * 1e3:.1f} ms (SLO {w.slo.tpot_p99_ms:g} ms); relax "
            f"the SLO to at least those figures plus queueing margin")


def _memory_relaxation(model: Model, w: Workload, catalog: Catalog, space: SearchSpace,
                       screen: _Screen) -> str:
    from planner.memory import weight_bytes

    lightest = min(space.weights, key=lambda p: weight_bytes(model, p))
    need = weight_bytes(model, lightest) / 1e9
    gpus = [catalog.gpu(n) for n in space.gpus] if space.gpus else list(catalog.gpus.values())
    most = max(space.tp) * max(space.pp)
    largest = max(g.memory_gb * most for g in gpus)
    msg = (f"weights need {need:.0f} GB at {lightest}; the largest option holds {largest:.0f} GB "
           f"({most} GPUs)")
    wider = replace(space, weights=("int4",), tp=(8,), pp=(1, 2, 4, 8), max_seqs=(16,),
                    spec=(None,), gpus=())
    for d in enumerate_deployments(model, catalog, wider):
        if screen.memory_of(d).fits:
            return msg + (f"; nearest feasible relaxation: {d.weights} weights on "
                          f"{d.gpus}x {d.gpu.name} ({d.layout})")
    return msg + "; no catalog GPU holds it even at int4 with 32 GPUs per replica"

