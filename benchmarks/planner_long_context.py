"""Long contexts: 128K-token workloads planned with and without context parallelism, each case
against the same search with that parallelism switched off, in the same run.

1. Decode context parallelism (DCP, the KV cache striped over the TP ranks, as vLLM 0.32 runs
   it): DeepSeek-V3 (MLA: its KV latent is copied on every TP rank) answering questions about
   128K-token documents (95% of each prompt a prefix-cache hit) on H200, FP8, DCP sizes
   (1, 2, 4, 8) against DCP 1 only.
2. Llama-3.1-70B (GQA, 8 KV heads) at 128K with a relaxed TTFT SLO (60 s): the best plan on
   H100/H200. vLLM allows DCP for it only above TP 8 (one node), so both searches agree, which
   the output shows.
3. Prefill context parallelism (CP: copies of a TP group, on other nodes, each taking a share
   of every prompt; vLLM's -pcp, SGLang's --attn-cp-size): DeepSeek-V3 answering over
   124K-token documents (no prefix hits) with TTFT p99 <= 10 s on H200. One node's prefill of
   such a prompt takes about 12 s, so no plan without CP can meet it; CP sizes (1, 2, 4)
   against CP 1 only.
4. The same for Llama-3.1-70B (TTFT p99 <= 8 s, one node's prefill about 10 s) on H100/H200:
   neither vLLM 0.32 nor SGLang 0.5.23 runs CP for its attention, so the search offers no CP
   plan and says so (its notes).
Prints one JSON object.

    .venv/bin/python benchmarks/planner_long_context.py
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from planner.catalog import load_catalog  # noqa: E402
from planner.search import SearchSpace, search  # noqa: E402
from planner.workload import Slo, Workload  # noqa: E402

KEYS = ("layout", "gpu", "tp", "pp", "dcp", "cp", "replicas", "gpus", "weights", "kv", "max_seqs",
        "ttft_p99_ms", "tpot_p99_ms", "cost_per_hour", "cost_per_1m_input_tokens",
        "cost_per_1m_output_tokens")


def run(model, w: Workload, space: SearchSpace, catalog, switched: str) -> dict:
    """The search over `space`, then again with `switched` ("dcp" or "cp") held at 1."""
    out = {"switched_off_in_baseline": switched}
    for name, s in (("with", space), ("baseline", replace(space, **{switched: (1,)}))):
        started = time.perf_counter()
        r = search(model, w, catalog, s)
        best = r.candidates[0] if r.candidates else None
        out[name] = {"evaluated": r.evaluated, "fitting": r.fitting,
                     "seconds": round(time.perf_counter() - started, 2),
                     "best": {k: best.as_dict()[k] for k in KEYS} if best else None,
                     "infeasible": r.infeasible or None, "notes": r.notes,
                     "why_layout": r.why_layout or None}
    a, b = out["with"]["best"], out["baseline"]["best"]
    out["baseline_cost_over_best_cost"] = (round(b["cost_per_hour"] / a["cost_per_hour"], 3)
                                           if a and b else None)
    out["workload"] = {"input_len": w.input_len, "output_len": w.output_len, "rate": w.rate,
                       "prefix_hit": space.prefix_hit, "ttft_p99_ms": w.slo.ttft_p99_ms,
                       "tpot_p99_ms": w.slo.tpot_p99_ms, "num_requests": w.num_requests}
    return out


def main() -> int:
    catalog = load_catalog()
    cases = {
        "DeepSeek-V3 128K documents, H200": run(
            catalog.model("DeepSeek-V3"),
            Workload(131072, 1024, rate=0.4, slo=Slo(20000, 100), num_requests=400),
            SearchSpace(gpus=("H200",), weights=("fp8",), kv=("fp8", "bf16"), tp=(4, 8),
                        pp=(1, 2), spec=(None,), max_seqs=(16, 64), prefix_hit=0.95), catalog,
            "dcp"),
        "Llama-3.1-70B 128K, H100/H200": run(
            catalog.model("Llama-3.1-70B"),
            Workload(126976, 1024, rate=0.05, slo=Slo(60000, 100), num_requests=200),
            SearchSpace(gpus=("H100 SXM", "H200"), spec=(None,), max_seqs=(16, 64), cp=(1,)),
            catalog, "dcp"),
        "DeepSeek-V3 124K documents, TTFT p99 10 s, H200": run(
            catalog.model("DeepSeek-V3"),
            Workload(126976, 1024, rate=0.05, slo=Slo(10000, 100), num_requests=200),
            SearchSpace(gpus=("H200",), weights=("fp8",), kv=("fp8", "bf16"), tp=(4, 8),
                        pp=(1, 2), spec=(None,), max_seqs=(16, 64)), catalog, "cp"),
        "Llama-3.1-70B 124K documents, TTFT p99 8 s, H100/H200": run(
            catalog.model("Llama-3.1-70B"),
            Workload(126976, 1024, rate=0.05, slo=Slo(8000, 100), num_requests=200),
            SearchSpace(gpus=("H100 SXM", "H200"), weights=("fp8", "bf16"), spec=(None,),
                        max_seqs=(16, 64)), catalog, "cp"),
    }
    print(json.dumps({
        "benchmark": "planner_long_context",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "baseline": "each case's same search with its context parallelism off (dcp 1 or cp 1), "
                    "same run",
        "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
