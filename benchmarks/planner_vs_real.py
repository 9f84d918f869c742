"""The planner's predictions against runs made on this machine (issue #19 item 1).

This machine is measured (engine/device_profile.py: read bandwidth, bf16 matmul, the engine's
step overhead) into a throwaway catalog; the demo model is planned on it at several
concurrencies and Poisson rates; each plan is run here (app/plan_run.py: `servescope serve`
with the plan's settings, driven by the load generator) and its throughput and p50/p99 TTFT and
TPOT are compared with the prediction. Then the planner is calibrated from ONE of the runs
(the first) and every point is predicted again: the errors before and after, the same runs.

Prints one JSON object: the machine, the device profile, per point the predictions
(uncalibrated, calibrated) and the measurement, and the median absolute percentage errors.
Prompt lengths are in tokens for both: the load generator sends token-id prompts of exactly the
planned length, drawn from the server's own /tokenize.

    .venv/bin/python benchmarks/planner_vs_real.py [--quick] [--weights bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

INPUT_TOKENS, OUTPUT_TOKENS = 52, 32
POINTS = ({"concurrency": 1}, {"concurrency": 4}, {"rate": 0.5}, {"rate": 2.0})
FIGURES = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def apes(predicted: dict, measured: dict) -> dict:
    return {k: round(abs(predicted[k] - measured[k]) / measured[k] * 100.0, 1)
            for k in FIGURES if measured.get(k)}


def median_apes(points: list[dict], which: str) -> dict:
    return {k: round(float(np.median([p[which][k] for p in points if k in p[which]])), 1)
            for k in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per point")
    parser.add_argument("--weights", default="bf16", choices=("bf16", "int8", "int4"))
    args = parser.parse_args()
    config_dir = Path(tempfile.mkdtemp(prefix="servescope-planner-vs-real-"))
    os.environ["SERVESCOPE_CONFIG_DIR"] = str(config_dir)

    from app.plan_run import PlanRun, demo_model_path, predicted_figures, run_here
    from engine.bench import machine
    from engine.device_profile import measure, write_entry
    from planner.calibrate import Calibration
    from planner.catalog import load_catalog
    from planner.evaluate import evaluate
    from planner.measured import calibrate_measured
    from planner.timing import Deployment
    from planner.workload import Workload
    from storage.db import open_database
    from storage.queries import list_runs

    profile = measure(quick=args.quick)
    write_entry(profile, config_dir)
    catalog = load_catalog(config_dir)
    here, model = catalog.gpu("this machine"), catalog.model("SmolLM2-135M")
    db = open_database(f"sqlite:///{config_dir / 'runs.db'}")
    requests = 6 if args.quick else 16
    points = []
    for load in POINTS:
        d = Deployment(model, here, args.weights, "bf16", max_seqs=8)
        w = Workload(INPUT_TOKENS, OUTPUT_TOKENS, num_requests=200, **load)
        ev = evaluate(d, w)
        run = PlanRun(SimpleNamespace(deployment=d, memory=ev.memory), w,
                      demo_model_path(model), requests, predicted_figures(ev))
        out = run_here(run, db, progress=lambda m: print(m, file=sys.stderr, flush=True))
        points.append({"load": load, "deployment": d, "workload": w, "run_id": out["run_id"],
                       "uncalibrated": out["predicted"], "measured": out["measured"]})
    # One calibration run: the first point's.
    first = [r for r in list_runs(db) if r["id"] == points[0]["run_id"]]
    report = calibrate_measured([], first, catalog, "one run here")
    for p in points:
        cal_ev = evaluate(p["deployment"], p["workload"], 1, report.calibration)
        p["calibrated"] = predicted_figures(cal_ev)
        p["error_before_pct"] = apes(p["uncalibrated"], p["measured"])
        p["error_after_pct"] = apes(p["calibrated"], p["measured"])
    db.close()
    assert isinstance(report.calibration, Calibration)
    result = {
        "benchmark": "planner_vs_real", "machine": machine(),
        "profile": {k: profile[k] for k in ("read_bandwidth_gbs", "matmul_tflops", "step")},
        "model": model.name, "weights": args.weights, "input_tokens": INPUT_TOKENS,
        "output_tokens": OUTPUT_TOKENS, "requests": requests,
        "calibration": {"name": report.calibration.name,
                        "factors": {f"{g} {w}": vars(e) for (g, w), e in
                                    report.calibration.factors.items()}},
        "points": [{k: v for k, v in p.items() if k not in ("deployment", "workload")}
                   for p in points],
        "median_error_before_pct": median_apes(points, "error_before_pct"),
        "median_error_after_pct": median_apes(points, "error_after_pct"),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
