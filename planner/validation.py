"""What each predicted figure rests on, and the error band the validation set gives it.

The validation set is assets/validation/published.json: published runs at a fixed batch or
concurrency (each with its source), the same set benchmarks/planner_validation.py reports on.
A band is the planner's absolute percentage error over that set's points for the metric: the
median and the largest, and the median signed error (positive: the planner predicts high).
Calibrated plans get the leave-one-out band for throughput (each point predicted by factors
fitted on the others), the honest error of a calibration on runs it has not seen.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from planner.calibrate import (
    Measurement,
    ape,
    deployment_for,
    fit,
    load_measurements,
    predict,
)
from planner.catalog import ASSETS, load_catalog
from planner.timing import Efficiency

DATA = ASSETS.parent / "validation" / "published.json"
UNCALIBRATED = "default (uncalibrated)"


@dataclass(frozen=True)
class Band:
    """A metric's error over the validation points that measure it."""

    metric: str
    points: int
    median_pct: float
    max_pct: float
    bias_pct: float
    against: str

    def as_dict(self) -> dict:
        return {"points": self.points, "median_abs_error_pct": round(self.median_pct, 1),
                "max_abs_error_pct": round(self.max_pct, 1),
                "median_signed_error_pct": round(self.bias_pct, 1), "against": self.against}


def _band(metric: str, pairs: list[tuple[float, float]], against: str) -> Band:
    errors = [ape(p, m) for p, m in pairs]
    signed = [(p - m) / m * 100.0 for p, m in pairs]
    return Band(metric, len(pairs), statistics.median(errors), max(errors),
                statistics.median(signed), against)


@lru_cache(maxsize=4)
def error_bands(path: Path = DATA) -> dict[str, Band]:
    """Bands for throughput (default factors, and leave-one-out calibrated), TPOT and TTFT."""
    catalog = load_catalog()
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    runs = load_measurements(path)
    engines = sorted({m.engine or m.source.split(",")[0] for m in runs})
    plain, loo = [], []
    for i, m in enumerate(runs):
        d = deployment_for(m, catalog)
        plain.append((predict(d, m, Efficiency())["throughput_tok_s"], m.throughput_tok_s))
        others = fit(runs[:i] + runs[i + 1:], catalog, "leave-one-out")
        loo.append((predict(d, m, others.efficiency(m.gpu, m.weights))["throughput_tok_s"],
                    m.throughput_tok_s))
    bands = {"throughput": _band("throughput", plain, f"{len(runs)} published runs ("
                                 + "; ".join(engines) + ")"),
             "throughput_calibrated": _band("throughput", loo, "the same runs, each predicted "
                                            "by factors fitted on the others")}
    for metric, key in (("tpot", "latency"), ("ttft", "latency_ttft")):
        rows = [Measurement(**r) for r in data.get(key, [])]
        pairs = [(predict(deployment_for(m, catalog), m, Efficiency())[f"{metric}_ms"],
                  getattr(m, f"{metric}_ms")) for m in rows]
        if pairs:
            bands[metric] = _band(metric, pairs, f"{len(pairs)} published {metric.upper()} "
                                  f"point(s) at fixed concurrency")
    return bands


def basis(calibration: str, simulated: bool = True) -> dict:
    """For each figure a plan reports: what it rests on and its band from the validation set."""
    bands = error_bands()
    calibrated = calibration != UNCALIBRATED
    model = ("roofline step model calibrated by " + repr(calibration) if calibrated else
             "roofline step model with default efficiencies (uncalibrated)")
    load = " and a discrete-event simulation of the load" if simulated else \
        " and the analytic steady state"
    throughput = bands["throughput_calibrated" if calibrated else "throughput"]
    tail = ("the band is the step model's at fixed concurrency; the p99 under Poisson load adds "
            "the simulator's queueing, which no published point measures")

    def entry(rests: str, band: Band | None, note: str = "") -> dict:
        out: dict = {"rests_on": rests, "error_band": band.as_dict() if band else None}
        if note:
            out["note"] = note
        return out

    return {
        "throughput_tok_s": entry(model + load, throughput),
        "tpot_p99_ms": entry(model + load, bands.get("tpot"), tail),
        "ttft_p99_ms": entry(model + load, bands.get("ttft"), tail),
        "cost_per_hour": entry("catalog prices (prices.toml, each with its source and date)",
                               None, "a list price: no model error, but prices move"),
        "cost_per_1m_tokens": entry("the hour's cost over the predicted throughput", throughput),
        "memory_gb_per_gpu": entry("weights, KV and activation formulas (planner.memory) and "
                                   "vLLM's reserve", None, "not validated against a measurement"),
    }
