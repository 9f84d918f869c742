"""Disaggregated prefill/decode serving: a prefill pool and a decode pool with the KV cache sent
between them, simulated request by request and ranked against aggregated plans.

A request goes to prefill replica i mod x and decode replica i mod y (vLLM's disaggregation
proxy picks both when the request arrives). The prefill replica runs prompts only (chunked, in
its token budget); the finished prompt's KV cache then crosses the network to the decode
replica, which pulls it (vLLM's NixlConnector) and computes the last prompt token itself, as
vLLM does when a request's whole prompt is already cached, to sample the first output token.
TTFT therefore counts the prefill queue, the prefill, the transfer (queued behind the transfers
into the same decode replica), the wait for a decode slot and that first step; TPOT counts
decode steps that never carry a prefill chunk, which is what the split buys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from planner.calibrate import Calibration
from planner.catalog import Catalog, Model
from planner.cost import CostOptions, cost_per_hour, cost_per_million, split_per_million
from planner.memory import MemoryPlan, kv_bytes_per_token, plan_memory
from planner.replica import max_context, replica_for
from planner.search import Plan, SearchSpace, enumerate_deployments, search, servable_only
from planner.simulate import SimResult, run_replica
from planner.timing import Deployment, StepCost
from planner.workload import Workload, requests

# One 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s per direction) on the compute fabric: NVIDIA's
# DGX BasePOD reference architecture, "Core Components" (DGX H100, H200 and B200: eight
# single-port ConnectX-7 VPI, up to 400 Gb/s InfiniBand/Ethernet). KV moves GPU to GPU over
# RDMA (NIXL/UCX), each GPU sending its own shard.
NIC_GBS = 50.0
# aiconfigurator's system YAMLs: 10 us point-to-point latency (research note planner.md, sec. 2).
TRANSFER_LATENCY_S = 10e-6
# Replicas tried beyond the analytic estimate of each pool before the pair is given up.
EXTRA_REPLICAS = 3


@dataclass(frozen=True)
class DisaggDeployment:
    """x prefill replicas of one layout and y decode replicas of another, same model, weights
    and KV precision (the decode side reads the KV cache the prefill side wrote)."""

    prefill: Deployment
    decode: Deployment
    prefill_replicas: int
    decode_replicas: int
    nic_gbs: float = NIC_GBS

    def __post_init__(self) -> None:
        p, d = self.prefill, self.decode
        if p.model.name != d.model.name:
            raise ValueError("prefill and decode pools must serve the same model")
        if (p.weights, p.kv) != (d.weights, d.kv):
            raise ValueError("prefill and decode pools need the same weight and KV precision: "
                             "the decode pool reads the KV cache the prefill pool wrote")
        if p.spec is not None:
            raise ValueError("speculative decoding belongs to the decode pool, not the prefill")
        if p.pp > 1 or d.pp > 1:
            raise ValueError("pipeline parallelism is not modelled in disaggregated pools")
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError("each pool needs at least one replica")
        if self.nic_gbs <= 0:
            raise ValueError("nic_gbs must be positive GB/s")

    @property
    def gpus(self) -> int:
        return (self.prefill.gpus * self.prefill_replicas
                + self.decode.gpus * self.decode_replicas)

    def transfer_seconds(self, prompt_tokens: float, link_eff: float) -> float:
        """One prompt's KV cache from a prefill replica to a decode replica: every GPU of the
        narrower side moves its shard over its own NIC at the same time."""
        size = prompt_tokens * kv_bytes_per_token(self.prefill.model, self.prefill.kv)
        links = min(self.prefill.gpus, self.decode.gpus)
        return TRANSFER_LATENCY_S + size / (links * self.nic_gbs * 1e9 * link_eff)


@dataclass(frozen=True)
class DisaggResult:
    """Per-request latencies through both pools, and where a request's TTFT went (means, s)."""

    sim: SimResult
    prefill_s: float  # queueing plus prefill on the prefill pool
    transfer_s: float  # KV transfer, its queue at the decode replica's NICs included
    decode_first_s: float  # waiting for a decode slot plus the step that samples token one


def simulate_disagg(dd: DisaggDeployment, w: Workload, calibration: Calibration | None = None
                    ) -> DisaggResult:
    """Simulate every prefill replica, the transfers, then decode replica 0 of y (round robin
    gives each decode replica the same traffic)."""
    if w.rate is None:
        raise ValueError("a disaggregated plan is simulated at a request rate")
    calibration = calibration or Calibration()
    arrivals, inputs, outputs = requests(w)
    n = len(arrivals)
    p_mem = _memory(dd.prefill, w, prefill=True)
    d_mem = _memory(dd.decode, w, prefill=False)
    for side, mem in (("prefill", p_mem), ("decode", d_mem)):
        if not mem.fits:
            raise ValueError(f"the {side} layout does not fit: {mem.reason}")
    p_rep = replica_for(dd.prefill, p_mem, calibration)
    ready = np.empty(n)
    for j in range(dd.prefill_replicas):
        take = np.arange(j, n, dd.prefill_replicas)
        s, _ = run_replica(p_rep, arrivals[take], inputs[take], np.ones(len(take)))
        ready[take] = s.first
    eff = calibration.efficiency(dd.decode.gpu.name, dd.decode.weights)
    mine = np.arange(0, n, dd.decode_replicas)
    mine = mine[np.argsort(ready[mine], kind="stable")]
    landed = np.empty(len(mine))
    link_free = 0.0
    for k, i in enumerate(mine):  # transfers into one decode replica share its NICs, FIFO
        start = max(ready[i], link_free)
        link_free = start + dd.transfer_seconds(inputs[i], eff.link)
        landed[k] = link_free
    d_rep = replica_for(dd.decode, d_mem, calibration)
    # The decode replica holds all but the last prompt token already (prefix_hit would round
    # them down): it computes that token, then decodes.
    s, preemptions = run_replica(replace(d_rep, prefix_hit=0.0), landed, inputs[mine],
                                 outputs[mine], precomputed=inputs[mine] - 1)
    keep = np.arange(len(mine))[len(mine) // 10:]  # the warm-up tenth starts from idle
    idx = mine[keep]
    first, finish = s.first[keep], s.finish[keep]
    out = outputs[idx].astype(float)
    tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
    span = max(float(np.ptp(landed)), float(np.ptp(s.finish)))
    throughput = float(outputs[mine].sum()) / span * dd.decode_replicas if span > 0 else math.inf
    sim = SimResult(first - arrivals[idx], tpot, finish - arrivals[idx], throughput,
                    preemptions, 0)
    return DisaggResult(sim, float(np.mean(ready[idx] - arrivals[idx])),
                        float(np.mean(landed[keep] - ready[idx])),
                        float(np.mean(first - landed[keep])))


def _memory(d: Deployment, w: Workload, prefill: bool) -> MemoryPlan:
    """A prefill replica holds prompts only until they are sent; a decode replica whole
    requests."""
    context = max_context(replace(w, output_len=1, output_dist="fixed")) if prefill else \
        max_context(w)
    return plan_memory(d.model, d.gpu, d.weights, d.kv, d.tp, d.pp, context,
                       d.max_batched_tokens, d.dcp)


@dataclass(frozen=True)
class DisaggPlan:
    """A disaggregated option that met the SLOs in simulation, with its cost."""

    deployment: DisaggDeployment
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    throughput_tok_s: float
    cost_per_hour: float
    cost_per_1m_tokens: float
    cost_per_1m_input: float
    cost_per_1m_output: float
    ttft_parts_ms: dict[str, float]
    calibration: str
    context: int = 0  # the longest request the decode pool's memory was sized for (tokens)

    def as_dict(self) -> dict:
        dd = self.deployment

        def pool(d: Deployment, replicas: int) -> dict:
            return {"gpu": d.gpu.name, "tp": d.tp, "replicas": replicas,
                    "gpus": d.gpus * replicas, "max_seqs": d.max_seqs,
                    "max_batched_tokens": d.max_batched_tokens}

        return {"mode": "disaggregated", "weights": dd.prefill.weights, "kv": dd.prefill.kv,
                "prefill": pool(dd.prefill, dd.prefill_replicas),
                "decode": pool(dd.decode, dd.decode_replicas), "gpus": dd.gpus,
                "ratio": f"{dd.prefill_replicas}P:{dd.decode_replicas}D",
                "kv_transfer": {"connector": "NixlConnector", "nic_gbs_per_gpu": dd.nic_gbs},
                "ttft_p99_ms": round(self.ttft_p99_ms, 3),
                "tpot_p99_ms": round(self.tpot_p99_ms, 3),
                "e2e_p99_ms": round(self.e2e_p99_ms, 3),
                "ttft_mean_parts_ms": {k: round(v, 3) for k, v in self.ttft_parts_ms.items()},
                "throughput_tok_s": round(self.throughput_tok_s, 2),
                "cost_per_hour": round(self.cost_per_hour, 4),
                "cost_per_1m_tokens": round(self.cost_per_1m_tokens, 4),
                "cost_per_1m_input_tokens": round(self.cost_per_1m_input, 4),
                "cost_per_1m_output_tokens": round(self.cost_per_1m_output, 4),
                "calibration": self.calibration, "basis": _basis(self.calibration)}


def _basis(calibration: str) -> dict:
    from planner.validation import basis

    out = basis(calibration)
    out["kv_transfer"] = {"rests_on": "KV bytes over one 400 Gb/s NIC per GPU at the link "
                                      "efficiency", "error_band": None,
                          "note": "not validated against a measured transfer"}
    return out


def plan_disagg(dd: DisaggDeployment, w: Workload, calibration: Calibration,
                opts: CostOptions) -> tuple[DisaggPlan, DisaggResult]:
    """Simulate one disaggregated deployment and price it. Each pool's GPU-hours are billed to
    its own tokens: the prefill pool's to the prompts, the decode pool's to the output."""
    res = simulate_disagg(dd, w, calibration)
    p_hour = cost_per_hour(dd.prefill.gpu, dd.prefill.gpus, dd.prefill_replicas, opts)
    d_hour = cost_per_hour(dd.decode.gpu, dd.decode.gpus, dd.decode_replicas, opts)
    hourly = p_hour + d_hour
    out_tok_s = w.rate * w.output_len
    inp, out = split_per_million(hourly, p_hour / hourly, w.rate * w.input_len, out_tok_s)
    sim = res.sim
    plan = DisaggPlan(dd, sim.summary("ttft")["p99"], sim.summary("tpot")["p99"],
                      sim.summary("e2e")["p99"], sim.throughput_tok_s, hourly,
                      cost_per_million(hourly, out_tok_s), inp, out,
                      {"prefill": res.prefill_s * 1e3, "kv_transfer": res.transfer_s * 1e3,
                       "decode_first_step": res.decode_first_s * 1e3}, calibration.name,
                      _memory(dd.decode, w, prefill=False).context)
    return plan, res


def _prefill_replicas(d: Deployment, w: Workload, eff_cal: Calibration) -> int:
    """Fewest prefill replicas whose M/D/1 queue keeps the mean TTFT share below half the SLO:
    service is one prompt's chunked prefill (the pool is compute-bound, prompts run one after
    another at the token budget)."""
    cost = StepCost(d, eff_cal.efficiency(d.gpu.name, d.weights))
    service = cost.prefill_seconds(w.input_len)
    budget = w.slo.ttft_p99_ms / 1e3
    if service >= budget:
        return 0
    x = max(1, math.ceil(w.rate * service / 0.95))
    while x < 10_000:
        rho = w.rate / x * service
        if rho < 1 and service + rho * service / (2 * (1 - rho)) <= budget / 2:
            return x
        x += 1
    return 0


def _decode_replicas(d: Deployment, w: Workload, mem: MemoryPlan, cal: Calibration) -> int:
    """Fewest decode replicas whose decode-only steady batch (Little's law) holds in the batch
    limit with its TPOT under the SLO."""
    cost = StepCost(d, cal.efficiency(d.gpu.name, d.weights))
    e = d.spec.tokens_per_step if d.spec else 1.0
    ctx = w.input_len + w.output_len / 2.0
    b_max = min(d.max_seqs, mem.max_sequences)
    slo = w.slo.tpot_p99_ms / 1e3
    if cost.decode_seconds(1, ctx) / e > slo:
        return 0
    y = max(1, math.ceil(w.rate * w.output_len * cost.decode_seconds(1, ctx) / e / b_max))
    while y < 10_000:
        batch = 1.0
        for _ in range(12):
            tpot = cost.decode_seconds(max(1, round(batch)), ctx) / e
            batch = w.rate / y * w.output_len * tpot
        if batch <= b_max and tpot <= slo:
            return y
        y += 1
    return 0


@dataclass(frozen=True)
class DisaggSearch:
    """Disaggregated plans meeting the SLOs, cheapest first, and what was looked at."""

    plans: list[DisaggPlan]
    pools_considered: int
    simulated: int
    notes: list[str] = field(default_factory=list)


def search_disagg(model: Model, w: Workload, catalog: Catalog, space: SearchSpace | None = None,
                  calibration: Calibration | None = None, cost_opts: CostOptions | None = None,
                  prefill_tokens: int = 8192, pairs: int = 3) -> DisaggSearch:
    """Size each pool analytically for every layout in `space` (prefill at a token budget of
    `prefill_tokens`, decode at the space's batch limits), then simulate the `pairs` cheapest
    prefill and decode pools of each (GPU, weights, KV) against each other, adding replicas to a
    pool until the simulated p99s meet the SLOs."""
    if w.rate is None:
        raise ValueError("search_disagg needs a workload with a request rate")
    space = replace(space or SearchSpace(), pp=(1,), cp=(1,))
    calibration, opts = calibration or Calibration(), cost_opts or CostOptions()
    candidates, dropped = servable_only(enumerate_deployments(model, catalog, space))
    groups: dict[tuple, tuple[list, list]] = {}
    considered = 0
    for d in candidates:
        key = (d.gpu.name, d.weights, d.kv)
        pre, dec = groups.setdefault(key, ([], []))
        considered += 1
        if d.spec is None and d.max_seqs == max(space.max_seqs):
            p = replace(d, max_batched_tokens=max(prefill_tokens, d.max_batched_tokens))
            if _memory(p, w, prefill=True).fits:
                x = _prefill_replicas(p, w, calibration)
                if x:
                    pre.append((cost_per_hour(p.gpu, p.gpus, x, opts), p, x))
        mem = _memory(d, w, prefill=False)
        if mem.fits:
            y = _decode_replicas(d, w, mem, calibration)
            if y:
                dec.append((cost_per_hour(d.gpu, d.gpus, y, opts), d, y))
    plans, simulated = [], 0
    for pre, dec in groups.values():
        pre = sorted(pre, key=lambda t: t[0])[:pairs]
        dec = _cheapest_shapes(dec, pairs)
        for (_, p, x), (_, d, y) in ((a, b) for a in pre for b in dec):
            plan, n = _confirm(p, x, d, y, w, calibration, opts)
            simulated += n
            if plan is not None:
                plans.append(plan)
    plans.sort(key=lambda p: (p.cost_per_hour, p.e2e_p99_ms))
    notes = [f"{n} candidate(s) not offered: {reason}" for reason, n in dropped.items()]
    return DisaggSearch(plans, considered, simulated, notes)


def _cheapest_shapes(pools: list, n: int) -> list:
    """The n cheapest decode pools of distinct shapes (one batch limit each)."""
    out, seen = [], set()
    for t in sorted(pools, key=lambda t: t[0]):
        key = (t[1].tp, t[1].spec)
        if key not in seen:
            seen.add(key)
            out.append(t)
        if len(out) == n:
            break
    return out


def _confirm(p: Deployment, x: int, d: Deployment, y: int, w: Workload, cal: Calibration,
             opts: CostOptions) -> tuple[DisaggPlan | None, int]:
    """Simulate the pair; grow the pool whose part of the latency misses until both p99s meet
    the SLOs or EXTRA_REPLICAS were added to each."""
    runs = 0
    x0, y0 = x, y
    while x <= x0 + EXTRA_REPLICAS and y <= y0 + EXTRA_REPLICAS:
        plan, res = plan_disagg(DisaggDeployment(p, d, x, y), w, cal, opts)
        runs += 1
        ttft_ok = plan.ttft_p99_ms <= w.slo.ttft_p99_ms
        tpot_ok = plan.tpot_p99_ms <= w.slo.tpot_p99_ms
        if ttft_ok and tpot_ok:
            return plan, runs
        if not tpot_ok or res.decode_first_s > res.prefill_s:
            y += 1  # decode slots are the bottleneck: TPOT, or TTFT spent waiting to decode
        else:
            x += 1
    return None, runs


@dataclass(frozen=True)
class Comparison:
    """The best aggregated and the best disaggregated plan under the same workload and SLOs,
    and the reason one beats the other, in figures."""

    aggregated: Plan | None
    disaggregated: DisaggPlan | None
    winner: str
    ratio: float  # the loser's $/hour over the winner's (inf when only one is feasible)
    reason: str

    def as_dict(self) -> dict:
        return {"winner": self.winner, "cost_ratio": round(self.ratio, 3),
                "reason": self.reason,
                "aggregated": None if self.aggregated is None else self.aggregated.as_dict(),
                "disaggregated": None if self.disaggregated is None
                else self.disaggregated.as_dict()}


def compare(model: Model, w: Workload, catalog: Catalog, space: SearchSpace | None = None,
            calibration: Calibration | None = None, cost_opts: CostOptions | None = None,
            prefill_tokens: int = 8192) -> Comparison:
    """Search both ways under the same SLOs and say which is cheaper, and why."""
    calibration, opts = calibration or Calibration(), cost_opts or CostOptions()
    agg = search(model, w, catalog, space, calibration=calibration, cost_opts=opts)
    dis = search_disagg(model, w, catalog, space, calibration, opts, prefill_tokens)
    a = agg.candidates[0] if agg.candidates else None
    b = dis.plans[0] if dis.plans else None
    if a is None and b is None:
        return Comparison(None, None, "none", math.nan,
                          "neither way meets the SLOs: " + (agg.infeasible or "relax them"))
    if b is None or (a is not None and a.cost_per_hour <= b.cost_per_hour):
        ratio = b.cost_per_hour / a.cost_per_hour if b else math.inf
        return Comparison(a, b, "aggregated", ratio, _why_aggregated(a, b, w, calibration))
    ratio = a.cost_per_hour / b.cost_per_hour if a else math.inf
    return Comparison(a, b, "disaggregated", ratio, _why_disaggregated(a, b, w, calibration))


def interference(d: Deployment, w: Workload, cal: Calibration, batch: int) -> tuple[float, float]:
    """(seconds of a decode step of `batch` sequences alone, seconds of the same step carrying
    one prefill chunk of the token budget): the cost a prompt imposes on every decode beside it
    when both phases share a replica."""
    cost = StepCost(d, cal.efficiency(d.gpu.name, d.weights))
    ctx = w.input_len + w.output_len / 2.0
    chunk = min(d.max_batched_tokens, w.input_len)
    alone = cost.decode_seconds(batch, ctx)
    mixed = cost.time(chunk, chunk * chunk / 2.0, batch, batch * ctx, batch + 1)
    return alone, mixed


def _why_disaggregated(a: Plan | None, b: DisaggPlan, w: Workload, cal: Calibration) -> str:
    dd = b.deployment
    split = f"{dd.gpus} GPUs ({dd.prefill_replicas}P:{dd.decode_replicas}D)"
    if a is None:
        return (f"no aggregated plan meets TTFT p99 <= {w.slo.ttft_p99_ms:g} ms and TPOT p99 <= "
                f"{w.slo.tpot_p99_ms:g} ms; separate pools do with {split}")
    # The decode pool's layout, run aggregated at the aggregated plans' token budget.
    shared = replace(dd.decode, max_batched_tokens=a.deployment.max_batched_tokens)
    batch = max(1, round(w.rate / dd.decode_replicas * w.output_len * b.tpot_p99_ms / 1e3))
    alone, mixed = interference(shared, w, cal, min(batch, shared.max_seqs))
    chunks = math.ceil(w.input_len / shared.max_batched_tokens)
    return (f"disaggregated {split} against {a.deployment.gpus * a.replicas} GPUs aggregated "
            f"({a.replicas}x TP{a.deployment.tp}): sharing a TP{shared.tp} replica, each "
            f"{w.input_len}-token prompt puts {chunks} prefill chunk(s) of "
            f"{shared.max_batched_tokens} tokens into the decode batch, and a decode step "
            f"carrying one takes {mixed * 1e3:.1f} ms against {alone * 1e3:.1f} ms without, "
            f"so under TPOT p99 <= {w.slo.tpot_p99_ms:g} ms the aggregated plan needs wider or "
            f"emptier replicas; the decode pool's steps carry no prefill (TPOT p99 "
            f"{b.tpot_p99_ms:.1f} ms) and the KV transfer adds "
            f"{b.ttft_parts_ms['kv_transfer']:.1f} ms to the mean TTFT")


def _why_aggregated(a: Plan, b: DisaggPlan | None, w: Workload, cal: Calibration) -> str:
    if b is None:
        return "no disaggregated pair meets the SLOs; the aggregated plan does"
    n_a, n_b = a.deployment.gpus * a.replicas, b.deployment.gpus
    transfer = b.ttft_parts_ms["kv_transfer"]
    if a.cost_per_hour == b.cost_per_hour:
        return (f"a tie at {n_a} GPUs (${a.cost_per_hour:.2f}/hour) each way; aggregated is "
                f"kept: one pool to run and no KV transfer ({transfer:.1f} ms of mean TTFT "
                f"disaggregated)")
    alone, mixed = interference(a.deployment, w, cal, max(1, min(
        a.deployment.max_seqs, round(w.rate / a.replicas * w.output_len
                                     * a.tpot_p99_ms / 1e3))))
    return (f"aggregated {n_a} GPUs (${a.cost_per_hour:.2f}/hour) against disaggregated {n_b} "
            f"(${b.cost_per_hour:.2f}/hour): a decode step carrying a prefill chunk takes "
            f"{mixed * 1e3:.1f} ms against {alone * 1e3:.1f} ms without, which TPOT p99 <= "
            f"{w.slo.tpot_p99_ms:g} ms tolerates, so a shared pool wastes less than two pools "
            f"each rounded up to whole replicas")
