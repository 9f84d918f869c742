"""Disaggregated prefill/decode against aggregated serving, same SLOs, same search space.

Two workloads on Llama-3.1-70B over H100 SXM (bf16, TP 1-8, no speculation): 16K-token prompts
with TPOT p99 <= 30 ms, where separate pools should win, and 512-token prompts with a loose TPOT,
where they should not. For each, the aggregated search's best plan is the same-run baseline: the
ratio is its $/hour over the disaggregated best's (> 1: disaggregated is cheaper). Prints one JSON
object.

    .venv/bin/python benchmarks/planner_disagg.py
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from planner.catalog import load_catalog  # noqa: E402
from planner.disagg import compare  # noqa: E402
from planner.search import SearchSpace  # noqa: E402
from planner.workload import Slo, Workload  # noqa: E402

SPACE = SearchSpace(gpus=("H100 SXM",), weights=("bf16",), kv=("bf16",), tp=(1, 2, 4, 8),
                    pp=(1,), spec=(None,), max_seqs=(64, 256))
CASES = {
    "long prompts, tight TPOT": Workload(16384, 512, rate=1.0, slo=Slo(8000, 30),
                                         num_requests=600),
    "short prompts, loose TPOT": Workload(512, 256, rate=8.0, slo=Slo(1000, 50),
                                          num_requests=600),
}


def _summary(p) -> dict | None:
    return None if p is None else {k: v for k, v in p.as_dict().items()
                                   if k not in ("memory_gb_per_gpu", "folded_variants")}


def main() -> int:
    catalog = load_catalog()
    model = catalog.model("Llama-3.1-70B")
    cases = {}
    for name, w in CASES.items():
        started = time.perf_counter()
        c = compare(model, w, catalog, SPACE)
        cases[name] = {
            "workload": {"input_len": w.input_len, "output_len": w.output_len, "rate": w.rate,
                         "ttft_p99_ms": w.slo.ttft_p99_ms, "tpot_p99_ms": w.slo.tpot_p99_ms,
                         "num_requests": w.num_requests},
            "winner": c.winner, "reason": c.reason,
            "baseline": "best aggregated plan of the same search space (same run)",
            "aggregated_over_disaggregated_cost": round(
                c.aggregated.cost_per_hour / c.disaggregated.cost_per_hour, 3)
            if c.aggregated and c.disaggregated else None,
            "aggregated": _summary(c.aggregated), "disaggregated": _summary(c.disaggregated),
            "seconds": round(time.perf_counter() - started, 2)}
    print(json.dumps({
        "benchmark": "planner_disagg",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "model": model.name, "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
