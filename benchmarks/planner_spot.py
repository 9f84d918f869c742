"""Spot pools through simulated interruptions, against all-on-demand pools, same run.

For each case the search picks the layout and replica count (on demand), then
planner.spot.plan_spot sizes pools with spot replicas so the p99 TTFT and TPOT hold while a spot
replica is reclaimed (AWS reclaim rates and notice, catalogs/spot.toml) and while every spot
replica is reclaimed at once; the baseline is the cheapest all-on-demand pool that holds in the
same simulation. Prints one JSON object: pools, SLO attainment (steady, in the interrupted
window, long run), $ per 1M input and output tokens, and the cost ratio to the baseline.

    .venv/bin/python benchmarks/planner_spot.py
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
from planner.search import SearchSpace, search  # noqa: E402
from planner.spot import load_spot_markets, plan_spot  # noqa: E402
from planner.workload import Slo, Workload  # noqa: E402

CASES = {
    "Llama-3.1-8B FP8 on L4, 6 req/s": (
        "Llama-3.1-8B", Workload(1000, 200, rate=6, slo=Slo(2000, 60), num_requests=600),
        SearchSpace(gpus=("L4",), weights=("fp8",), kv=("fp8",), tp=(1,), pp=(1,),
                    spec=(None,))),
    "Llama-3.1-70B FP8 on H100, 4 req/s": (
        "Llama-3.1-70B", Workload(1000, 200, rate=4, slo=Slo(2000, 50), num_requests=600),
        SearchSpace(gpus=("H100 SXM",), weights=("fp8",), kv=("fp8",), tp=(2, 4), pp=(1,),
                    spec=(None,))),
}


def main() -> int:
    catalog, markets = load_catalog(), load_spot_markets()
    cases = {}
    for name, (model, w, space) in CASES.items():
        started = time.perf_counter()
        best = search(catalog.model(model), w, catalog, space).candidates[0]
        d = best.deployment
        market = markets[d.gpu.name, "aws"]
        one, on_demand = plan_spot(d, w, best.replicas, market)
        together, _ = plan_spot(d, w, best.replicas, market, correlated=True)
        cases[name] = {
            "layout": {"gpu": d.gpu.name, "tp": d.tp, "weights": d.weights, "kv": d.kv,
                       "max_seqs": d.max_seqs, "search_replicas": best.replicas},
            "baseline": "cheapest all-on-demand pool holding the p99 SLOs, same simulation",
            "on_demand": on_demand.as_dict(), "one_reclaimed": one.as_dict(),
            "all_spot_reclaimed_at_once": together.as_dict(),
            "on_demand_cost_over_spot_cost": {
                "one_reclaimed": round(on_demand.cost_per_hour / one.cost_per_hour, 3),
                "all_spot_reclaimed_at_once": round(
                    on_demand.cost_per_hour / together.cost_per_hour, 3)},
            "seconds": round(time.perf_counter() - started, 2)}
    print(json.dumps({
        "benchmark": "planner_spot",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
