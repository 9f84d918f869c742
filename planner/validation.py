"""What each predicted figure rests on, and the error band the validation set gives it.

The validation set is assets/validation/published.json: published runs at a fixed batch or
concurrency (each with its source), the same set benchmarks/planner_validation.py reports on.
Its "measurements" are throughput runs; its "latency_points" are TTFT and TPOT published at a
fixed concurrency, each predicted as its benchmark ran: a static batch (TensorRT-LLM's
gptSessionBenchmark, vLLM's benchmark_latency) by the step model's prefill-then-decode sum, a
serving benchmark's closed loop (NIM's GenAI-Perf tables) by simulating that loop on the
replica the memory model gives, KV-cache limit and queueing included.
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

import numpy as np

from planner.calibrate import (
    Calibration,
    Measurement,
    ape,
    deployment_for,
    fit,
    load_measurements,
    predict,
)
from planner.catalog import ASSETS, Catalog, CatalogError, load_catalog
from planner.replica import memory_for, replica_for
from planner.simulate import simulate
from planner.timing import Efficiency
from planner.workload import Workload

DATA = ASSETS.parent / "validation" / "published.json"
UNCALIBRATED = "default (uncalibrated)"


@dataclass(frozen=True)
class LatencyPoint:
    """A published TTFT and/or TPOT at a fixed concurrency, and how its benchmark ran.

    mode "static": one batch of `concurrency` prompts prefilled, then decoded together.
    mode "continuous": a serving benchmark's closed loop, `concurrency` requests in flight.
    tpot_is "e2e_per_token": the figure is a whole run's time over its output tokens (prefill
    included), as TensorRT-LLM's peak-throughput and vLLM's latency tables give it; "decode":
    the time between tokens. statistic: "mean" or "median" of the benchmark's requests."""

    model: str
    gpu: str
    weights: str
    kv: str
    tp: int
    pp: int
    concurrency: int
    input_len: int
    output_len: int
    mode: str
    statistic: str
    engine: str
    source: str
    date: str = ""
    tpot_ms: float | None = None
    tpot_is: str = "decode"
    ttft_ms: float | None = None
    quote: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if min(self.concurrency, self.input_len, self.output_len) < 1:
            raise ValueError("concurrency, input_len and output_len must be at least 1")
        self.as_measurement()  # the mode, checked as a measurement's is
        if self.statistic not in ("mean", "median"):
            raise ValueError("statistic must be 'mean' or 'median'")
        if self.tpot_is not in ("decode", "e2e_per_token"):
            raise ValueError("tpot_is must be 'decode' or 'e2e_per_token'")
        if self.tpot_ms is None and self.ttft_ms is None:
            raise ValueError("a latency point needs tpot_ms or ttft_ms")

    def as_measurement(self) -> Measurement:
        """The point as the step model's predict() takes it (its throughput unused)."""
        return Measurement(self.model, self.gpu, self.weights, self.kv, self.tp, self.pp,
                           self.concurrency, self.input_len, self.output_len, 1.0, self.mode,
                           engine=self.engine)


def load_latency_points(path: Path = DATA) -> list[LatencyPoint]:
    """The file's "latency_points"; an error names the file and the row."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = data.get("latency_points", []) if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise CatalogError(f"{path}: field 'latency_points' must be a list")
    points = []
    for i, row in enumerate(rows):
        try:
            points.append(LatencyPoint(**row))
        except (TypeError, ValueError) as exc:
            raise CatalogError(f"{path}: latency_points[{i}]: {exc}") from exc
    return points


# A closed loop is simulated for this many rounds of its concurrency; the first round, which
# starts every request at once on an empty server, is dropped as the benchmarks' warm-up is.
CLOSED_LOOP_ROUNDS = 8


def predict_latency(point: LatencyPoint, catalog: Catalog,
                    calibration: Calibration | None = None) -> dict[str, float]:
    """The point's TTFT and TPOT (ms) as its benchmark measured them."""
    calibration = calibration or Calibration()
    m = point.as_measurement()
    d = deployment_for(m, catalog)
    if point.mode == "static":
        pred = predict(d, m, calibration.efficiency(d.gpu.name, d.weights))
        if point.tpot_is == "e2e_per_token":
            total = pred["ttft_ms"] + pred["tpot_ms"] * (point.output_len - 1)
            pred = {**pred, "tpot_ms": total / point.output_len}
        return {"ttft_ms": pred["ttft_ms"], "tpot_ms": pred["tpot_ms"]}
    n = point.concurrency
    w = Workload(point.input_len, point.output_len, concurrency=n,
                 num_requests=n * CLOSED_LOOP_ROUNDS)
    memory = memory_for(d, w)
    if not memory.fits:
        raise ValueError(f"{point.model} on {d.gpus}x {point.gpu}: {memory.reason}")
    result = simulate(replica_for(d, memory, calibration), w)
    steady = slice(n, None)
    pick = np.mean if point.statistic == "mean" else np.median
    return {"ttft_ms": float(pick(result.ttft[steady])) * 1e3,
            "tpot_ms": float(pick(result.tpot[steady])) * 1e3}


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
    points = load_latency_points(path)
    predicted = [predict_latency(p, catalog) for p in points]
    for metric in ("tpot", "ttft"):
        key = f"{metric}_ms"
        pairs = [(pred[key], getattr(p, key)) for p, pred in zip(points, predicted, strict=True)
                 if getattr(p, key) is not None]
        if pairs:
            engines = sorted({p.engine for p in points if getattr(p, key) is not None})
            bands[metric] = _band(metric, pairs, f"{len(pairs)} published {metric.upper()} "
                                  f"point(s) at fixed concurrency (" + "; ".join(engines) + ")")
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
