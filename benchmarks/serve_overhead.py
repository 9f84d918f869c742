"""What serving a streamed token costs `servescope serve` at batch 1, by the HTTP stack it runs on.

The engine steps on its own thread and uvicorn (asyncio, h11) answers on another, in one
process; each token is handed to the event loop (engine/server.py's _Mailbox) and written as a
server-sent event. This runs the same server under uvicorn's other event loop and protocol
(uvloop, httptools: `pip install uvloop httptools`; a variant whose module is missing is left
out and said so) and with the engine's OpenMP worker spinning less between steps
(`spin-1000`), and reports, per variant, what the load generator sees (output tok/s, TPOT p50)
and what the server spends per token: the HTTP thread's CPU time (`time.thread_time()` over its
life, divided by the tokens it streamed) and how long the engine thread waits in the hand-over
(it can stall on the GIL while the HTTP thread runs). The engine is also driven in-process on the
same prompts (peer_vllm.py's in-process worker), so served over in-process is in the report too.

Variants and the in-process run alternate for `--rounds` rounds (the shared machine's load
falls on all of them alike); each figure is the median over the rounds. Prints one JSON object.

    .venv/bin/python benchmarks/serve_overhead.py [--weights int4] [--rounds 2] [--requests 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_vllm  # noqa: E402 - the servers' start/stop, the load and the in-process worker

VARIANTS = {  # name: (uvicorn loop, uvicorn http, the modules it needs, environment)
    "asyncio-h11": (None, None, (), {}),  # what `servescope serve` runs
    "uvloop": ("uvloop", None, ("uvloop",), {}),
    "httptools": (None, "httptools", ("httptools",), {}),
    "uvloop-httptools": ("uvloop", "httptools", ("uvloop", "httptools"), {}),
    # The engine's OpenMP worker waits for the next parallel region spinning (libgomp's default:
    # 300,000 spins, milliseconds), so it holds a core through the engine thread's Python
    # between steps, when the HTTP thread and the client want one; 1,000 spins still cover the
    # gaps between a step's own regions (100 did not: a step took 2.5x as long). Measured 0.96x
    # the default's tokens/s (int4, 3 rounds, the Zen 4 EPYC): waking the worker for each step's
    # first region cost more than the core it freed, so the default stays.
    "spin-1000": (None, None, (), {"GOMP_SPINCOUNT": "1000"}),
}
MARK = "SERVE_OVERHEAD "


# ---- the server, instrumented (a child process) ----
def server_child(variant: str, serve_args: list[str]) -> int:
    """`servescope serve` under `variant`'s loop and protocol, printing its per-token costs at
    exit. The protocol replaces the server's own (GuardedH11Protocol: its slowloris deadline
    is not part of the streamed path)."""
    import uvicorn

    from app.cli import main
    from engine import server

    loop, http, _, _ = VARIANTS[variant]
    config_init = uvicorn.Config.__init__

    def config(self, *args, **kwargs):
        if loop is not None:
            kwargs["loop"] = loop
        if http is not None:
            kwargs["http"] = http
        config_init(self, *args, **kwargs)

    uvicorn.Config.__init__ = config
    waits: list[float] = []
    post = server._Mailbox.post

    def timed_post(self, queue, item):
        start = time.perf_counter()
        try:
            return post(self, queue, item)
        finally:
            waits.append(time.perf_counter() - start)

    server._Mailbox.post = timed_post
    http_cpu: dict = {}
    serve_http = server.Server._serve_http

    def timed_serve_http(self):
        start = time.thread_time()
        try:
            serve_http(self)
        finally:
            http_cpu["s"] = time.thread_time() - start

    server.Server._serve_http = timed_serve_http
    try:
        return main(["serve", *serve_args])  # returns once the HTTP thread has been joined
    finally:
        print(MARK + json.dumps({"http_cpu_s": http_cpu.get("s"), "deliveries": len(waits),
                                 "wait_us": sorted(w * 1e6 for w in waits)}),
              file=sys.stderr, flush=True)


# ---- the parent ----
def measure_variant(variant: str, args: argparse.Namespace, log_dir: Path) -> dict:
    port = peer_vllm.vs.free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--server-child", variant, "--",
               "--port", str(port), "--weights", args.weights]
    env = {**os.environ, **VARIANTS[variant][3]}
    server = peer_vllm.Running(variant, command, env, port, log_dir / f"{variant}.log")
    try:
        server.wait_healthy()
        peer_vllm.warm_up(server, args)
        load = peer_vllm.drive(server, 1, args)
    finally:
        server.stop()
    costs = _child_report(server.log)
    tokens = args.requests * args.output_len + 4 * 16  # the measured requests and the warm-up
    waits = costs["wait_us"][len(costs["wait_us"]) // 10:] or [0.0]  # past the first requests
    return {**load,
            "http_thread_cpu_ms_per_token": None if costs["http_cpu_s"] is None
            else costs["http_cpu_s"] * 1e3 / tokens,
            "engine_handover_wait_us_p50": statistics.median(waits),
            "engine_handover_wait_us_p90": waits[int(0.9 * (len(waits) - 1))]}


def _child_report(log: Path) -> dict:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"the server left no report: {log.read_text(errors='replace')[-2000:]}")


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]
            if all(isinstance(r[key], (int, float)) for r in runs)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--server-child"]:
        return server_child(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="int4", help="`servescope serve --weights` (default int4)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=8,
                   help="batch-1 requests a measurement (the in-process side runs 8)")
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args(argv)
    args.quick = False
    missing = {v: [m for m in VARIANTS[v][2] if importlib.util.find_spec(m) is None]
               for v in args.variants}
    variants = [v for v in args.variants if not missing[v]]
    peer_vllm.requests_at = lambda concurrency, quick: args.requests  # batch-1 requests
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    in_process: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for variant in variants:
                print(f"round {round_ + 1}: {variant}", file=sys.stderr, flush=True)
                runs[variant].append(measure_variant(variant, args, Path(tmp)))
            args.concurrency = [1]
            in_process.append(peer_vllm.in_process(args, f"--weights {args.weights}")
                              ["concurrency"]["1"])
    inproc = medians(in_process)
    result = {v: medians(r) for v, r in runs.items()}
    base = result.get("asyncio-h11")
    for figures in result.values():
        figures["served_over_in_process"] = \
            figures["output_tokens_per_s"] / inproc["output_tokens_per_s"]
        if base is not None:
            figures["tokens_per_s_over_asyncio_h11"] = \
                figures["output_tokens_per_s"] / base["output_tokens_per_s"]
    print(json.dumps({
        "benchmark": "serve_overhead", "machine": peer_vllm.machine(),
        "weights": args.weights, "rounds": args.rounds, "requests": args.requests,
        "output_len": args.output_len, "in_process": inproc, "variants": result,
        "left_out": {v: f"not installed: {', '.join(m)}" for v, m in missing.items() if m},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
