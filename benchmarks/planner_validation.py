"""Planner predictions vs published measurements: throughput and latency errors, as one JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from planner.calibrate import ape, deployment_for, fit, load_measurements, predict  # noqa: E402
from planner.catalog import load_catalog  # noqa: E402
from planner.timing import Efficiency  # noqa: E402

DATA = _HERE.parent / "assets" / "validation" / "published.json"
TARGET_MAPE = 20.0


def main() -> int:
    catalog = load_catalog()
    runs = load_measurements(DATA)
    latency = json.loads(DATA.read_text())["latency"]
    rows, loo = [], []
    for i, m in enumerate(runs):
        d = deployment_for(m, catalog)
        pred = predict(d, m, Efficiency())["throughput_tok_s"]
        # Leave-one-out: calibrate on the other rows, predict this one.
        others = fit(runs[:i] + runs[i + 1:], catalog, "loo")
        pred_loo = predict(d, m, others.efficiency(m.gpu, m.weights))["throughput_tok_s"]
        rows.append({"model": m.model, "gpu": m.gpu, "tp": m.tp, "batch": m.batch,
                     "input_len": m.input_len, "output_len": m.output_len,
                     "measured_tok_s": m.throughput_tok_s, "predicted_tok_s": round(pred, 1),
                     "error_pct": round(ape(pred, m.throughput_tok_s), 1),
                     "loo_calibrated_error_pct": round(ape(pred_loo, m.throughput_tok_s), 1)})
        loo.append(ape(pred_loo, m.throughput_tok_s))
    lat_rows = []
    for row in latency:
        m = load_measurements_row(row)
        pred = predict(deployment_for(m, catalog), m, Efficiency())
        lat_rows.append({"model": m.model, "gpu": m.gpu, "batch": m.batch,
                         "measured_tpot_ms": m.tpot_ms,
                         "predicted_tpot_ms": round(pred["tpot_ms"], 2),
                         "error_pct": round(ape(pred["tpot_ms"], m.tpot_ms), 1)})
    ttft_rows = []
    for row in json.loads(DATA.read_text())["latency_ttft"]:
        m = load_measurements_row(row)
        pred = predict(deployment_for(m, catalog), m, Efficiency())
        ttft_rows.append({"model": m.model, "gpu": m.gpu, "tp": m.tp, "input_len": m.input_len,
                          "measured_ttft_ms": m.ttft_ms,
                          "predicted_ttft_ms": round(pred["ttft_ms"], 2),
                          "error_pct": round(ape(pred["ttft_ms"], m.ttft_ms), 1)})
    mape = statistics.median(r["error_pct"] for r in rows)
    # The default FLOPs factor is a prior, not a fit: show what the previous default gives.
    at_06 = statistics.median(
        ape(predict(deployment_for(m, catalog), m, Efficiency(flops=0.6))["throughput_tok_s"],
            m.throughput_tok_s) for m in runs)
    print(json.dumps({
        "benchmark": "planner_validation", "data": str(DATA.relative_to(_HERE.parent)),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "points": len(rows), "default_efficiency": Efficiency().__dict__,
        "throughput_median_ape_pct": round(mape, 1),
        "throughput_median_ape_loo_calibrated_pct": round(statistics.median(loo), 1),
        "throughput_median_ape_flops_0_6_pct": round(at_06, 1),
        "target_pct": TARGET_MAPE, "target_met": mape <= TARGET_MAPE,
        "target_met_loo_calibrated": statistics.median(loo) <= TARGET_MAPE,
        "latency_tpot": lat_rows,
        "latency_ttft_median_ape_pct": round(statistics.median(r["error_pct"] for r in ttft_rows),
                                             1),
        "latency_ttft": ttft_rows, "rows": rows}, indent=1))
    return 0


def load_measurements_row(row: dict):
    from planner.calibrate import Measurement

    return Measurement(**row)


if __name__ == "__main__":
    sys.exit(main())
