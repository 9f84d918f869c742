"""Planner predictions vs published measurements: throughput and latency errors, as one JSON.

Throughput: the published TensorRT-LLM runs, with default factors and leave-one-out calibrated.
Latency: every published TTFT and TPOT at a fixed concurrency (assets/validation/published.json,
"latency_points"), each predicted as its benchmark ran (planner.validation.predict_latency).

Baseline in the same run: the plain roofline (no kernel floor, no ridge blend), the model before
those two terms. The two terms' defaults are the best point of a small grid over all the points;
the held-out figures pick them without each source in turn (leave one source out) and predict
that source with what the others chose, which is the error to expect on a source not seen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from planner.calibrate import (  # noqa: E402
    Calibration,
    ape,
    deployment_for,
    fit,
    load_measurements,
    predict,
)
from planner.catalog import load_catalog  # noqa: E402
from planner.timing import Efficiency  # noqa: E402
from planner.validation import DATA, load_latency_points, predict_latency  # noqa: E402

TARGETS = {"throughput": 20.0, "tpot": 10.0, "ttft": 25.0}
FLOOR_GRID_US = (0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0)
BLEND_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


def point_errors(eff: Efficiency, catalog, runs, points) -> list[dict]:
    """Signed % error of every figure the set publishes, with its source and metric."""
    calibration = Calibration("grid", {("*", "*"): eff})
    out = []
    for m in runs:
        pred = predict(deployment_for(m, catalog), m, eff)["throughput_tok_s"]
        out.append({"source": m.engine, "metric": "throughput", "measured": m.throughput_tok_s,
                    "predicted": pred})
    for p in points:
        pred = predict_latency(p, catalog, calibration)
        for metric in ("ttft", "tpot"):
            measured = getattr(p, f"{metric}_ms")
            if measured is not None:
                out.append({"source": p.engine, "metric": metric, "measured": measured,
                            "predicted": pred[f"{metric}_ms"]})
    for e in out:
        e["error_pct"] = (e["predicted"] - e["measured"]) / e["measured"] * 100.0
    return out


def medians(errors: list[dict]) -> dict[str, float]:
    """Median absolute error % per metric."""
    return {metric: round(statistics.median(abs(e["error_pct"]) for e in errors
                                            if e["metric"] == metric), 1)
            for metric in TARGETS if any(e["metric"] == metric for e in errors)}


def score(errors: list[dict]) -> float:
    """One number to pick grid points by: the mean of the metrics' median errors."""
    return statistics.mean(medians(errors).values())


def held_out(grid: dict[tuple[float, float], list[dict]]) -> tuple[list[dict], dict]:
    """Each source predicted with the grid point that fits the other sources best."""
    sources = sorted({e["source"] for e in next(iter(grid.values()))})
    pooled, chosen = [], {}
    for source in sources:
        best = min(grid, key=lambda k: score([e for e in grid[k] if e["source"] != source]))
        chosen[source] = {"kernel_floor_us": best[0], "ridge_blend": best[1]}
        pooled += [e for e in grid[best] if e["source"] == source]
    return pooled, chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-grid", action="store_true",
                        help="skip the grid and the held-out figures (a few seconds, not a minute)")
    args = parser.parse_args(argv)
    catalog = load_catalog()
    runs = load_measurements(DATA)
    points = load_latency_points(DATA)
    default = Efficiency()
    errors = point_errors(default, catalog, runs, points)
    plain = point_errors(Efficiency(kernel_floor_us=0.0, ridge_blend=0.0), catalog, runs, points)
    loo = []
    for i, m in enumerate(runs):
        others = fit(runs[:i] + runs[i + 1:], catalog, "loo")
        pred = predict(deployment_for(m, catalog), m, others.efficiency(m.gpu, m.weights))
        loo.append(ape(pred["throughput_tok_s"], m.throughput_tok_s))
    now, before = medians(errors), medians(plain)
    by_source = {}
    for source in sorted({e["source"] for e in errors}):
        by_source[source] = medians([e for e in errors if e["source"] == source])
    result = {
        "benchmark": "planner_validation", "data": str(DATA.relative_to(_HERE.parent)),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "throughput_points": len(runs),
        "latency_points": len(points),
        "figures": {metric: sum(e["metric"] == metric for e in errors) for metric in TARGETS},
        "default_efficiency": default.__dict__,
        "median_abs_error_pct": now,
        "median_abs_error_pct_plain_roofline": before,
        "error_ratio_plain_over_default": {k: round(before[k] / now[k], 2) for k in now},
        "median_abs_error_pct_by_source": by_source,
        "throughput_median_ape_loo_calibrated_pct": round(statistics.median(loo), 1),
        "targets_pct": TARGETS,
        "targets_met": {k: now[k] <= TARGETS[k] for k in now},
    }
    if not args.no_grid:
        grid = {(f, b): point_errors(Efficiency(kernel_floor_us=f, ridge_blend=b), catalog,
                                     runs, points)
                for f, b in itertools.product(FLOOR_GRID_US, BLEND_GRID)}
        best = min(grid, key=lambda k: score(grid[k]))
        pooled, chosen = held_out(grid)
        result["grid_best"] = {"kernel_floor_us": best[0], "ridge_blend": best[1],
                               "median_abs_error_pct": medians(grid[best])}
        result["median_abs_error_pct_held_out_by_source"] = medians(pooled)
        result["held_out_choice_by_source"] = chosen
        result["targets_met_held_out"] = {k: v <= TARGETS[k]
                                          for k, v in medians(pooled).items()}
    result["points"] = [
        {"source": e["source"], "metric": e["metric"], "measured": e["measured"],
         "predicted": round(e["predicted"], 2), "error_pct": round(e["error_pct"], 1)}
        for e in errors]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
