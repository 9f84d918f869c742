"""Chart contents as plain data (no Qt): the Pareto front, latency spread, day cost and memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.panes.planner.state import (
    FormState,
    day_cost,
    latency_histogram,
    memory_parts,
    plan_label,
)
from planner.evaluate import Evaluation
from planner.search import Plan, SearchResult

# Colour-blind-safe (Okabe-Ito), readable on the dark and the light palette alike.
COLOURS = ("#56b4e9", "#e69f00", "#009e73", "#cc79a7", "#f0e442", "#0072b2", "#d55e00")
SLO_COLOUR = "#d55e00"


@dataclass
class Series:
    """One data series: points, a polyline or bars (bars use xs as left edges of equal width)."""

    name: str
    xs: list[float]
    ys: list[float]
    colour: str
    style: str = "points"


@dataclass
class Stacked:
    """Horizontal stacked bars: one row per label, one segment per part."""

    rows: list[str]
    parts: list[str]
    values: list[list[float]]


@dataclass
class ChartSpec:
    """Everything a chart draws; the same spec paints the pane and the report's PNGs."""

    title: str
    x_label: str = ""
    y_label: str = ""
    series: list[Series] = field(default_factory=list)
    vlines: list[tuple[float, str]] = field(default_factory=list)
    hlines: list[tuple[float, str]] = field(default_factory=list)
    stacked: Stacked | None = None
    note: str = ""

    @property
    def empty(self) -> bool:
        return not any(s.xs for s in self.series) and not (self.stacked and self.stacked.rows)


def pareto_chart(result: SearchResult, chosen: Plan | None) -> ChartSpec:
    """Every feasible plan by $/hour and p99 end-to-end latency, the front joined by a line."""
    spec = ChartSpec("Cost vs p99 latency (Pareto front)", "$ / hour", "p99 end-to-end (s)")
    plans = result.candidates
    spec.series.append(Series("plans", [p.cost_per_hour for p in plans],
                              [p.e2e_p99_ms / 1e3 for p in plans], COLOURS[0]))
    front = result.pareto
    spec.series.append(Series("Pareto front", [p.cost_per_hour for p in front],
                              [p.e2e_p99_ms / 1e3 for p in front], COLOURS[1], "line"))
    if chosen is not None:
        spec.series.append(Series(plan_label(chosen), [chosen.cost_per_hour],
                                  [chosen.e2e_p99_ms / 1e3], COLOURS[2], "marker"))
    spec.note = f"{len(plans)} feasible of {result.evaluated} candidates"
    return spec


def latency_chart(detail: Evaluation | None, metric: str, slo_ms: float) -> ChartSpec:
    """The simulated distribution of TTFT or TPOT with its p99 and the SLO marked."""
    name = metric.upper()
    spec = ChartSpec(f"Simulated {name} distribution", f"{name} (ms)", "requests")
    if detail is None:
        return spec
    values = getattr(detail.result, metric)
    lefts, counts = latency_histogram(values)
    spec.series.append(Series(name, lefts, [float(c) for c in counts], COLOURS[0], "bars"))
    p99 = detail.result.summary(metric)["p99"]
    spec.vlines.append((p99, f"p99 {p99:.0f}"))
    if slo_ms < float("inf"):
        spec.vlines.append((slo_ms, f"SLO {slo_ms:g}"))
    return spec


def day_cost_chart(plan: Plan | None, form: FormState, spot_share: float | None = None,
                   rate_scale: float = 1.0, extra_replicas: int = 0) -> ChartSpec:
    """$ per hour across the day (autoscaled replicas follow the daily profile)."""
    spec = ChartSpec("Cost over a day", "hour of day", "$ / hour")
    if plan is None:
        return spec
    hourly = day_cost(plan, form, spot_share, rate_scale, extra_replicas)
    spec.series.append(Series("$/hour", [float(h) for h in range(24)], hourly, COLOURS[5],
                              "bars"))
    spec.note = f"${sum(hourly):,.0f} per day, ${sum(hourly) * 30:,.0f} per 30 days"
    return spec


def memory_chart(plans: list[Plan], limit: int = 5) -> ChartSpec:
    """Per-GPU memory of the leading plans with distinct layouts, split by use."""
    spec = ChartSpec("Memory per GPU (GB)", "GB", "")
    seen: set[tuple] = set()
    rows, values, parts = [], [], []
    for plan in plans:
        d = plan.deployment
        key = (d.gpu.name, d.weights, d.kv, d.layout)
        if key in seen:
            continue
        seen.add(key)
        split = memory_parts(plan)
        parts = [name for name, _ in split]
        rows.append(f"{d.layout} {d.gpu.name} {d.weights}/{d.kv}")
        values.append([v for _, v in split])
        if len(rows) == limit:
            break
    spec.stacked = Stacked(rows, parts, values)
    return spec


def all_charts(result: SearchResult | None, chosen: Plan | None, detail: Evaluation | None,
               form: FormState, spot_share: float | None = None, rate_scale: float = 1.0,
               extra_replicas: int = 0) -> dict[str, ChartSpec]:
    """The pane's five charts by key, for the chart grid and the report alike."""
    plans = result.candidates if result is not None else []
    ordered = ([chosen] if chosen is not None else []) + [p for p in plans if p is not chosen]
    return {
        "pareto": pareto_chart(result, chosen) if result is not None
        else ChartSpec("Cost vs p99 latency (Pareto front)"),
        "ttft": latency_chart(detail, "ttft", form.ttft_p99_ms),
        "tpot": latency_chart(detail, "tpot", form.tpot_p99_ms),
        "day_cost": day_cost_chart(chosen, form, spot_share, rate_scale, extra_replicas),
        "memory": memory_chart(ordered),
    }
