"""Spot interruptions in the simulation: a pool of spot and on-demand replicas of one layout,
one spot replica reclaimed mid-run, its requests drained, lost or migrated, its replacement
cold-started, and the pool sized so the p99 SLOs hold through it.

An interruption starts with the provider's notice: the router sends the replica nothing new,
requests on it keep running until the notice ends, and those still running then are lost, or
(migrate) re-sent to the surviving replicas with what they generated so far appended to the
prompt, to be recomputed there. A replacement is requested at the notice and serves once its
cold start (image pull plus weight load at the storage's bandwidth) is over. Long-run SLO
attainment weighs the interrupted window by how often a spot replica is interrupted: the
provider's monthly reclaim share p gives a per-instance rate -ln(1 - p) / (hours in a month).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from planner.calibrate import Calibration
from planner.catalog import ASSETS, build, config_dir, read_toml
from planner.evaluate import token_prices
from planner.memory import GB, weight_bytes
from planner.replica import memory_for, replica_for
from planner.simulate import Replica, run_replica
from planner.timing import Deployment
from planner.workload import Workload, requests

HOURS_PER_MONTH = 730.0  # 8,760 hours a year / 12
MIB = 1024 * 1024


@dataclass(frozen=True)
class SpotMarket:
    """One provider's spot offer for one GPU: how often it reclaims instances, with what notice."""

    gpu: str
    provider: str
    instance: str
    monthly_low: float
    monthly_high: float
    notice_s: float
    source: str
    date: str
    notice_source: str

    def __post_init__(self) -> None:
        if not 0.0 <= self.monthly_low <= self.monthly_high < 1.0:
            raise ValueError("monthly_low and monthly_high must satisfy 0 <= low <= high < 1")
        if self.notice_s < 0:
            raise ValueError("notice_s must be non-negative seconds")

    def hazard_per_hour(self, share: float | None = None) -> float:
        """Interruptions per instance-hour for a monthly reclaim share (the band's middle by
        default): P(reclaimed within a month) = 1 - exp(-rate x hours)."""
        p = (self.monthly_low + self.monthly_high) / 2.0 if share is None else share
        return -math.log1p(-p) / HOURS_PER_MONTH


def load_spot_markets(user_dir: Path | None = None) -> dict[tuple[str, str], SpotMarket]:
    """The shipped assets/catalogs/spot.toml, entries overridden or added by the user's file."""
    out: dict[tuple[str, str], SpotMarket] = {}
    for path in (ASSETS / "spot.toml", (user_dir or config_dir()) / "catalogs" / "spot.toml"):
        if not path.is_file():
            continue
        for gpu, providers in read_toml(path).get("spot", {}).items():
            for provider, values in providers.items():
                values = {k: str(v) if k == "date" else v for k, v in values.items()}
                market = build(_Entry, f"{gpu}.{provider}", values, path, "spot")
                out[gpu, provider] = SpotMarket(gpu, provider, **market.fields())
    return out


@dataclass(frozen=True)
class _Entry:
    """A spot.toml entry as written (catalog.build names the file and field on any problem)."""

    name: str
    instance: str
    monthly_low: float
    monthly_high: float
    notice_s: float
    source: str
    date: str
    notice_source: str

    def fields(self) -> dict:
        return {k: getattr(self, k) for k in ("instance", "monthly_low", "monthly_high",
                                              "notice_s", "source", "date", "notice_source")}


# vllm/vllm-openai:latest is 28.6 GB unpacked (vllm PR #22377, Dec 2025); its layers are
# written to the instance's disk as they are pulled, the extraction bounding the pull.
IMAGE_GB = 28.6
# An EBS gp3 volume's most provisioned throughput at creation: 1,000 MiB/s (AWS EC2 API
# reference, CreateVolume Throughput). Weights are read from it, the image written to it.
STORAGE_GBS = 1000 * MIB / GB


@dataclass(frozen=True)
class ColdStart:
    """What a replacement replica waits for before it serves. Provisioning (the provider finding
    capacity and booting the instance) is not published; it counts only when given."""

    image_gb: float = IMAGE_GB
    storage_gbs: float = STORAGE_GBS
    provisioning_s: float = 0.0

    def seconds(self, d: Deployment) -> float:
        weights = weight_bytes(d.model, d.weights) / GB
        return self.provisioning_s + (self.image_gb + weights) / self.storage_gbs


@dataclass(frozen=True)
class PoolRun:
    """Every request through a pool with at most one interruption: latencies (s), whether it
    met both SLOs, and what the interruption did."""

    arrival: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    met: np.ndarray
    lost: int
    migrated: int
    window: tuple[float, float]  # arrivals affected: in flight at the notice to replacement

    def attainment(self, in_window: bool | None = None) -> float:
        mask = self._mask(in_window)
        return float(self.met[mask].mean()) if mask.any() else math.nan

    def p99(self, metric: str, in_window: bool | None = None) -> float:
        values = getattr(self, metric)[self._mask(in_window)]
        values = values[np.isfinite(values)]
        return float(np.percentile(values, 99) * 1e3) if values.size else math.inf

    def _mask(self, in_window: bool | None) -> np.ndarray:
        keep = np.arange(len(self.arrival)) >= len(self.arrival) // 10  # warm-up tenth
        if in_window is None:
            return keep
        inside = (self.arrival >= self.window[0]) & (self.arrival <= self.window[1])
        return keep & (inside if in_window else ~inside)


def simulate_pool(replica: Replica, w: Workload, replicas: int,
                  interrupt: tuple[int, ...] = (), at: float = 0.0, notice_s: float = 0.0,
                  cold_s: float = 0.0, migrate: bool = True) -> PoolRun:
    """Round-robin over the replicas taking requests; the replicas in `interrupt` get their
    notice at `at` seconds, stop at `at + notice_s`, and their replacements serve from
    `at + cold_s`. Every replica is simulated (not one standing for all)."""
    if w.rate is None:
        raise ValueError("a pool is simulated at a request rate")
    hit = set(interrupt)
    if not hit <= set(range(replicas)):
        raise ValueError(f"interrupted replicas {sorted(hit)} must be among 0..{replicas - 1}")
    arrivals, inputs, outputs = requests(w)
    n = len(arrivals)
    end, back = at + notice_s, at + cold_s
    if len(hit) == replicas and back > at:
        raise ValueError("every replica interrupted at once leaves nothing to serve; keep "
                         "at least one on demand")
    # Instance 2k is slot k's first machine, 2k + 1 its replacement (interrupted slots only).
    owner = np.empty(n, dtype=np.int64)
    turn = 0
    for i, t in enumerate(arrivals):
        while True:
            k = turn % replicas
            turn += 1
            if k not in hit or not at <= t < back:
                owner[i] = 2 * k + (1 if k in hit and t >= back else 0)
                break
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    lost = migrated = 0
    survivors = [k for k in range(replicas) if k not in hit or back <= end]
    moved: dict[int, list[tuple[int, float, float, float]]] = {}  # instance -> requests
    for k in sorted(hit):
        mine = np.flatnonzero(owner == 2 * k)
        if mine.size == 0:
            continue
        s, _ = run_replica(replica, arrivals[mine], inputs[mine], outputs[mine])
        done = s.finish <= end
        first[mine[done]], finish[mine[done]] = s.first[done], s.finish[done]
        for local in np.flatnonzero(~done):
            i, began = mine[local], s.first[local]
            gen = 0.0
            if began < end:  # tokens out before the stop, at the request's own pace
                share = (end - began) / max(s.finish[local] - began, 1e-12)
                gen = 1.0 + math.floor(share * (outputs[i] - 1))
                first[i] = began
            if not migrate or not survivors:
                lost += 1
                continue
            migrated += 1
            target = survivors[migrated % len(survivors)]
            inst = 2 * target + (1 if target in hit else 0)
            moved.setdefault(inst, []).append((int(i), end, inputs[i] + gen,
                                               max(outputs[i] - gen, 1.0)))
    for inst in range(2 * replicas):
        if inst % 2 == 0 and inst // 2 in hit:
            continue
        mine = np.flatnonzero(owner == inst)
        extra = moved.get(inst, [])
        if mine.size == 0 and not extra:
            continue
        ids = np.concatenate([mine, np.array([m[0] for m in extra], dtype=np.int64)])
        t = np.concatenate([arrivals[mine], [m[1] for m in extra]])
        p = np.concatenate([inputs[mine], [m[2] for m in extra]]).astype(np.int64)
        o = np.concatenate([outputs[mine], [m[3] for m in extra]]).astype(np.int64)
        order = np.argsort(t, kind="stable")
        s, _ = run_replica(replica, t[order], p[order], o[order])
        for j, i in enumerate(ids[order]):
            if math.isnan(first[i]):
                first[i] = s.first[j]
            finish[i] = s.finish[j]
    out = outputs.astype(float)
    ttft = first - arrivals
    tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
    met = (np.isfinite(finish) & (ttft * 1e3 <= w.slo.ttft_p99_ms)
           & (tpot * 1e3 <= w.slo.tpot_p99_ms))
    window = (math.inf, math.inf)
    if hit:  # from requests in flight at the notice to the replacements' first minute's worth
        settled = np.isfinite(finish)
        e2e = float(np.percentile(finish[settled] - arrivals[settled], 99))
        window = (at - e2e, max(back, end) + e2e)
    return PoolRun(arrivals, ttft, tpot, met, lost, migrated, window)


@dataclass(frozen=True)
class SpotPlan:
    """A mixed pool, what an interruption does to it, and what it costs."""

    deployment: Deployment
    spot: int
    on_demand: int
    market: SpotMarket
    cold_start_s: float
    cost_per_hour: float
    cost_per_1m_input: float
    cost_per_1m_output: float
    attainment_steady: float
    attainment_window: float
    attainment_long_run: float
    ttft_p99_window_ms: float
    tpot_p99_window_ms: float
    lost: int
    migrated: int
    interruptions_per_month: float
    holds: bool
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        m = self.market
        return {"spot_replicas": self.spot, "on_demand_replicas": self.on_demand,
                "gpus": (self.spot + self.on_demand) * self.deployment.gpus,
                "cost_per_hour": round(self.cost_per_hour, 4),
                "cost_per_1m_input_tokens": round(self.cost_per_1m_input, 4),
                "cost_per_1m_output_tokens": round(self.cost_per_1m_output, 4),
                "slo_attainment": {"steady": round(self.attainment_steady, 4),
                                   "interrupted_window": round(self.attainment_window, 4),
                                   "long_run": round(self.attainment_long_run, 6)},
                "window_p99_ms": {"ttft": round(self.ttft_p99_window_ms, 1),
                                  "tpot": round(self.tpot_p99_window_ms, 2)},
                "requests_lost": self.lost, "requests_migrated": self.migrated,
                "interruptions_per_month": round(self.interruptions_per_month, 3),
                "cold_start_s": round(self.cold_start_s, 1), "slos_hold": self.holds,
                "market": {"gpu": m.gpu, "provider": m.provider, "instance": m.instance,
                           "monthly_reclaimed": [m.monthly_low, m.monthly_high],
                           "notice_s": m.notice_s, "source": m.source, "date": m.date},
                "notes": self.notes}


def plan_spot(d: Deployment, w: Workload, replicas: int, market: SpotMarket,
              cold: ColdStart | None = None, calibration: Calibration | None = None,
              migrate: bool = True, correlated: bool = False,
              max_spares: int = 2) -> tuple[SpotPlan, SpotPlan]:
    """(the cheapest pool whose p99 TTFT and TPOT hold through a spot interruption, the
    all-on-demand pool of `replicas` as the baseline). Candidates: `replicas` plus up to
    `max_spares` spares, any number of them spot. An interruption takes one spot replica, or
    with `correlated` every spot replica at once (a provider reclaiming a whole capacity pool);
    it is simulated a quarter into the run, which is lengthened to cover it twice over."""
    if market.gpu != d.gpu.name:
        raise ValueError(f"the spot market is for {market.gpu}, the deployment runs on "
                         f"{d.gpu.name}; pick the market for its GPU")
    if d.gpu.spot is None:
        raise ValueError(f"{d.gpu.name} has no spot price in prices.toml; add one to plan spot")
    calibration, cold = calibration or Calibration(), cold or ColdStart()
    memory = memory_for(d, w)
    replica = replica_for(d, memory, calibration)
    cold_s = cold.seconds(d)
    need = math.ceil(2 * (market.notice_s + cold_s) / 0.75 * w.rate)
    if w.num_requests < need:
        w = replace(w, num_requests=need)
    at = 0.25 * w.num_requests / w.rate
    hazard = market.hazard_per_hour()
    steady = {total: simulate_pool(replica, w, total)
              for total in range(replicas, replicas + max_spares + 1)}
    events: dict[tuple[int, int], PoolRun] = {}
    pools: list[SpotPlan] = []
    for total, calm in steady.items():
        pools.append(_plan(d, w, memory, calibration, market, total, 0, calm, calm, hazard,
                           cold_s))
        for spot in range(1, total + 1):
            hit = tuple(range(spot)) if correlated else (0,)
            if len(hit) == total and cold_s > 0:
                continue  # nothing would serve until the replacements are up
            key = (total, len(hit))
            if key not in events:
                events[key] = simulate_pool(replica, w, total, hit, at, market.notice_s,
                                            cold_s, migrate)
            pools.append(_plan(d, w, memory, calibration, market, total - spot, spot, calm,
                               events[key], hazard, cold_s))
    cheapest = sorted(pools, key=lambda p: (p.cost_per_hour, -p.attainment_long_run))
    on_demand = [p for p in cheapest if p.spot == 0]
    baseline = next((p for p in on_demand if p.holds), on_demand[0])
    best = next((p for p in cheapest if p.holds), None)
    if best is None:
        note = (f"no pool of {replicas} to {replicas + max_spares} replicas holds the p99 SLOs "
                f"over a run of {w.num_requests} requests, interrupted or not; the search's "
                f"shorter run ({len(steady)} sizes tried) was luckier: add replicas or relax "
                f"the SLOs")
        return replace(baseline, notes=[note]), baseline
    if best.spot == 0:
        best = replace(best, notes=["no pool with spot replicas that holds the p99 SLOs "
                                    "through an interruption is cheaper than all on demand"])
    return best, baseline


def _plan(d: Deployment, w: Workload, memory, calibration: Calibration, market: SpotMarket,
          on_demand: int, spot: int, steady: PoolRun, event: PoolRun, hazard: float,
          cold_s: float) -> SpotPlan:
    """Price one pool and weigh its interrupted window by how often one comes: a spot replica
    spans ceil(GPUs / 8) instances, each reclaimed on its own, and a replacement is billed
    through its cold start while it cannot serve."""
    per_hour = spot * math.ceil(d.gpus / 8) * hazard
    hourly = d.gpus * (spot * d.gpu.spot * (1 + hazard * cold_s / 3600.0)
                       + on_demand * d.gpu.on_demand)
    total = spot + on_demand
    if spot:
        window_h = (event.window[1] - event.window[0]) / 3600.0
        f = min(1.0, per_hour * window_h)
        a_win = event.attainment(in_window=True)
        long_run = (1 - f) * steady.attainment() + f * a_win
        ttft99, tpot99 = event.p99("ttft", True), event.p99("tpot", True)
        lost, moved = event.lost, event.migrated
    else:
        a_win = long_run = steady.attainment()
        ttft99, tpot99 = steady.p99("ttft"), steady.p99("tpot")
        lost = moved = 0
    holds = ttft99 <= w.slo.ttft_p99_ms and tpot99 <= w.slo.tpot_p99_ms
    inp, out = token_prices(d, w, total, memory, calibration, hourly)
    return SpotPlan(d, spot, on_demand, market, cold_s, hourly, inp, out, steady.attainment(),
                    a_win, long_run, ttft99, tpot99, lost, moved, per_hour * HOURS_PER_MONTH,
                    holds)
