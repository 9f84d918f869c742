"""Plain-Python state of the Planner pane: the form, search outcomes, what-ifs and scenarios."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from planner.calibrate import Calibration
from planner.catalog import Catalog, Model, config_dir
from planner.cost import CostOptions, cost_per_hour, hourly_replicas
from planner.evaluate import Evaluation
from planner.search import Plan, SearchResult, SearchSpace
from planner.timing import SpecDecode
from planner.workload import Slo, Workload

# 24 hourly multipliers of the peak rate; the peak hour is 1.0 so the form's rate is the peak.
DAILY_PROFILES: dict[str, tuple[float, ...]] = {
    "flat": (),
    "business hours": tuple([0.15] * 7 + [0.6, 0.9, 1.0, 1.0, 0.95, 0.85, 1.0, 1.0, 0.95, 0.8,
                                          0.5] + [0.3] * 6),
    "consumer evenings": tuple([0.35, 0.25, 0.2, 0.15, 0.15, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6,
                                0.65, 0.7, 0.65, 0.6, 0.6, 0.65, 0.75, 0.85, 0.95, 1.0, 0.95,
                                0.8, 0.55]),
}
MAX_SCENARIOS = 3
FORM_FILE = "planner-form.json"


@dataclass(frozen=True)
class FormState:
    """Everything the workload and options form holds, as plain values."""

    model: str = "Llama-3.1-8B"
    rate: float = 5.0
    profile: str = "business hours"
    arrival: str = "poisson"
    input_len: int = 1024
    input_dist: str = "lognormal"
    output_len: int = 256
    output_dist: str = "lognormal"
    prefix_share: float = 0.0
    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 100.0
    budget_per_hour: float = 0.0  # 0 means no budget
    gpus: tuple[str, ...] = ("H100 SXM", "A100 80GB", "L40S", "L4")
    weights: tuple[str, ...] = ("bf16", "fp8", "int4")
    kv: tuple[str, ...] = ("bf16", "fp8")
    speculative: bool = True
    spot_share: float = 0.0
    autoscale: bool = True
    num_requests: int = 400
    # Acceptance by draft position a monitored server measured (the source's name and its
    # rates); empty: the assumed 70% a token.
    spec_measured_on: str = ""
    spec_accepted_at: tuple[float, ...] = ()

    def workload(self, rate_scale: float = 1.0) -> Workload:
        """The planner's Workload; raises ValueError with the planner's sentence when invalid."""
        return Workload(self.input_len, self.output_len, rate=self.rate * rate_scale,
                        arrival=self.arrival, cv=1.5 if self.arrival == "gamma" else 1.0,
                        input_dist=self.input_dist, output_dist=self.output_dist,
                        prefix_share=self.prefix_share,
                        slo=Slo(self.ttft_p99_ms, self.tpot_p99_ms),
                        num_requests=self.num_requests,
                        daily_profile=DAILY_PROFILES.get(self.profile, ()))

    def spec_decode(self) -> SpecDecode:
        """The speculation planned: as measured on a monitored server where one is chosen."""
        if self.spec_accepted_at:
            return SpecDecode.from_measured(self.spec_accepted_at, self.spec_measured_on)
        return SpecDecode()

    def space(self) -> SearchSpace:
        """The search space the options select; empty selections are a user error."""
        if not self.gpus or not self.weights or not self.kv:
            raise ValueError("choose at least one GPU type, one weight precision and one KV "
                             "precision")
        spec = (None, self.spec_decode()) if self.speculative else (None,)
        return SearchSpace(gpus=self.gpus, weights=self.weights, kv=self.kv, spec=spec,
                           prefix_hit=self.prefix_share)

    def cost_options(self, spot_share: float | None = None) -> CostOptions:
        share = self.spot_share if spot_share is None else spot_share
        return CostOptions(spot_share=share, autoscale=self.autoscale)

    @property
    def budget(self) -> float | None:
        return self.budget_per_hour if self.budget_per_hour > 0 else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FormState:
        """A form from saved JSON; unknown keys are dropped and bad values fall back to defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        try:
            return cls(**values)
        except TypeError:
            return cls()


def load_form(folder: Path | None = None) -> FormState:
    """The form the user left last time, or the defaults."""
    path = (folder or config_dir()) / FORM_FILE
    try:
        return FormState.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return FormState()


def save_form(form: FormState, folder: Path | None = None) -> Path:
    """Write the form beside the user's catalogs (settings.py has no planner keys)."""
    path = (folder or config_dir()) / FORM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(form.to_json(), indent=2), encoding="utf-8")
    return path


@dataclass(frozen=True)
class Outcome:
    """One finished search: the inputs it ran on, its ranking and the detail of the chosen plan."""

    form: FormState
    model: Model
    catalog: Catalog
    result: SearchResult
    detail: Evaluation | None = None
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def best(self) -> Plan | None:
        return self.result.candidates[0] if self.result.candidates else None


@dataclass(frozen=True)
class Failure:
    """A planner failure a user can fix, carrying the planner's one-sentence explanation.

    Returned rather than raised: the runner would prefix a raised error with its type name."""

    message: str


def plan_label(plan: Plan) -> str:
    """'2x TP2 H100 SXM fp8/fp8 (+spec)', the name a plan goes by in tables and charts."""
    d = plan.deployment
    spec = " +spec" if d.spec is not None else ""
    return f"{plan.replicas}x {d.layout} {d.gpu.name} {d.weights}/{d.kv}{spec}"


TABLE_COLUMNS = ("Plan", "GPUs", "$/hour day avg", "$/1M tok", "TTFT p99 ms", "TPOT p99 ms",
                 "E2E p99 ms", "tok/s", "GB/GPU", "max seqs")


def table_row(plan: Plan) -> tuple[Any, ...]:
    """One ranked-table row, numbers kept numeric so the table sorts them as numbers."""
    return (plan_label(plan), plan.deployment.gpus * plan.replicas, plan.cost_per_hour,
            plan.cost_per_1m_tokens, plan.ttft_p99_ms, plan.tpot_p99_ms, plan.e2e_p99_ms,
            plan.throughput_tok_s, plan.memory.total_gb, plan.deployment.max_seqs)


@dataclass(frozen=True)
class WhatIf:
    """Changed assumptions applied to a chosen plan without a new search."""

    rate_scale: float = 1.0
    spot_share: float | None = None
    replicas_delta: int = 0

    @property
    def is_identity(self) -> bool:
        return self.rate_scale == 1.0 and self.spot_share is None and self.replicas_delta == 0


def day_cost(plan: Plan, form: FormState, spot_share: float | None = None,
             rate_scale: float = 1.0, extra_replicas: int = 0) -> list[float]:
    """$ for each hour of the day: replicas follow the profile when autoscaling, else stay put."""
    w = form.workload(rate_scale)
    opts = form.cost_options(spot_share)
    d = plan.deployment
    # The searched replica count serves the peak, so one replica serves peak / replicas.
    per_replica = form.rate / plan.replicas
    if form.autoscale and w.daily_profile:
        hours = hourly_replicas(plan.replicas, w.rate, w.daily_profile, per_replica)
    else:
        peak = max(plan.replicas, math.ceil(w.rate / per_replica - 1e-9))
        hours = [peak] * 24
    return [cost_per_hour(d.gpu, d.gpus, max(1, r + extra_replicas), opts) for r in hours]


@dataclass(frozen=True)
class PlanCosts:
    """What a plan costs: $/hour at the peak hour, $/hour averaged over the day, $ per day."""

    peak_per_hour: float
    average_per_hour: float
    per_day: float

    def text(self) -> str:
        """The sentence every view uses, so the pane, the What-if panel and the report agree."""
        return (f"${self.peak_per_hour:.2f}/hour at peak, ${self.average_per_hour:.2f}/hour "
                f"averaged over the day (${self.per_day:,.0f}/day)")


def plan_costs(plan: Plan, form: FormState, spot_share: float | None = None,
               rate_scale: float = 1.0, extra_replicas: int = 0) -> PlanCosts:
    """Peak and day-average cost from the hourly costs (the peak hour runs the searched
    replicas; autoscaling trims the others)."""
    hours = day_cost(plan, form, spot_share, rate_scale, extra_replicas)
    return PlanCosts(max(hours), sum(hours) / len(hours), sum(hours))


def latency_histogram(values_s: np.ndarray, bins: int = 30) -> tuple[list[float], list[int]]:
    """(bin left edges in ms, counts) of a latency sample, for the distribution chart."""
    ms = np.asarray(values_s, dtype=float) * 1e3
    ms = ms[np.isfinite(ms)]
    if ms.size == 0:
        return [], []
    counts, edges = np.histogram(ms, bins=bins)
    return [float(e) for e in edges[:-1]], [int(c) for c in counts]


def memory_parts(plan: Plan) -> list[tuple[str, float]]:
    """Per-GPU memory by use (GB), ending with what is left unused of the card."""
    m = plan.memory
    parts = [("weights", m.weights_gb), ("KV", max(m.kv_gb, 0.0)),
             ("activations", m.activations_gb), ("reserve", m.reserve_gb)]
    free = plan.deployment.gpu.memory_gb - sum(v for _, v in parts)
    return parts + [("free", max(free, 0.0))]


SCENARIO_FIELDS: list[tuple[str, Any]] = [
    ("Model", lambda o: o.form.model),
    ("Peak rate", lambda o: f"{o.form.rate:g} req/s ({o.form.profile})"),
    ("Lengths in/out", lambda o: f"{o.form.input_len} / {o.form.output_len}"),
    ("SLO p99 TTFT / TPOT", lambda o: f"{o.form.ttft_p99_ms:g} / {o.form.tpot_p99_ms:g} ms"),
    ("Recommended", lambda o: plan_label(o.best)),
    ("$/hour at peak", lambda o: f"{plan_costs(o.best, o.form).peak_per_hour:.2f}"),
    ("$/hour, day average", lambda o: f"{plan_costs(o.best, o.form).average_per_hour:.2f}"),
    ("$ per 1M tokens", lambda o: f"{o.best.cost_per_1m_tokens:.3f}"),
    ("$/day", lambda o: f"{sum(day_cost(o.best, o.form)):.0f}"),
    ("TTFT p99", lambda o: f"{o.best.ttft_p99_ms:.0f} ms"),
    ("TPOT p99", lambda o: f"{o.best.tpot_p99_ms:.1f} ms"),
    ("Feasible plans", lambda o: str(len(o.result.candidates))),
    ("Calibration", lambda o: o.best.calibration),
]


def scenario_column(outcome: Outcome) -> dict[str, str]:
    """One scenario's side-by-side values, as text a database row can keep."""
    return {label: get(outcome) for label, get in SCENARIO_FIELDS}


@dataclass
class Scenarios:
    """Up to three kept scenarios shown side by side; the oldest goes when a fourth is kept.

    Each is kept as the JSON row the database stores, so a reloaded scenario shows exactly
    as it did without searching again."""

    items: list[dict[str, Any]] = field(default_factory=list)

    def keep(self, outcome: Outcome, name: str = "") -> str:
        if outcome.best is None:
            raise ValueError("this workload has no feasible plan to keep as a scenario")
        label = name or f"{outcome.form.model} @ {outcome.form.rate:g} req/s"
        self._add({"name": label, "form": outcome.form.to_json(),
                   "plan": outcome.best.as_dict(), "column": scenario_column(outcome)})
        return label

    def restore(self, rows: list[dict[str, Any]]) -> int:
        """Add stored rows (oldest first); rows without a name or column are skipped."""
        good = [r for r in rows if isinstance(r, dict) and isinstance(r.get("column"), dict)
                and r.get("name")]
        for row in good:
            self._add(row)
        return len(good)

    def _add(self, row: dict[str, Any]) -> None:
        self.items.append(row)
        del self.items[:-MAX_SCENARIOS]

    def clear(self) -> None:
        self.items.clear()

    def comparison(self) -> tuple[list[str], list[tuple[str, list[str]]]]:
        """(scenario names, rows of (field, value per scenario)) for the side-by-side table."""
        names = [row["name"] for row in self.items]
        return names, [(label, [str(row["column"].get(label, "")) for row in self.items])
                       for label, _ in SCENARIO_FIELDS]

    def as_json(self) -> list[dict[str, Any]]:
        """The scenarios as JSON rows for storage.queries.save_plan."""
        return [dict(row) for row in self.items]
