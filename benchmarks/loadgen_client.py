"""The load generator's streaming client: aiohttp (monitor/loadgen.py) against httpx (its client
before), on one `servescope serve`, alternating.

On a machine the client shares with the server under test, the client's CPU time per streamed
token is taken from the server, so a heavier client reads the server slower. One server is
started (`--serve-args`, default `--weights int4`: its batch-1 kernels are compute-bound, so
they lose most to a neighbour), then for `--rounds` rounds each client, in a process of its own,
streams the same `--requests` prompts one at a time (64 words, 64 tokens, greedy, ignore_eos),
the two in turn. The aiohttp side is the load generator itself (`run_load`); the httpx side
reads the stream as `send_one` did with httpx before (`AsyncClient.stream`, `aiter_lines`).
Prints one JSON object: the machine, per client the median served tok/s and the client's CPU
time per streamed token, and the ratios.

    .venv/bin/python benchmarks/loadgen_client.py [--rounds 4] [--serve-args "--weights int4"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peer_vllm import Running, machine  # noqa: E402
from tests.vllm import server as vs  # noqa: E402 - free_port

# One client run in a child process: prints {"tok_s", "cpu_ms_per_token"}.
CLIENT = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from monitor.loadgen import LoadSpec, make_prompt, run_load
url, model, kind, requests = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
rng = np.random.default_rng(1)
prompts = [make_prompt(64, rng) for _ in range(requests)]

async def with_httpx():
    import httpx
    tokens = 0
    async with httpx.AsyncClient(timeout=300) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 64, "stream": True,
                    "temperature": 0.0, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    tokens += bool(event.get("choices") and event["choices"][0].get("text"))
    return tokens

cpu, wall = time.process_time(), time.perf_counter()
if kind == "httpx":
    tokens = asyncio.run(with_httpx())
else:
    summary = run_load(LoadSpec(url, model=model, concurrency=1, requests=requests,
                                input_len=64, output_len=64, seed=1,
                                server_estimates=False)).summary
    tokens = summary["output_tokens_per_s"] * summary["duration_s"]
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"tok_s": tokens / wall, "cpu_ms_per_token": cpu / tokens * 1e3}))
"""


def client_run(server: Running, kind: str, requests: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENT, str(ROOT), server.url, server.model(),
                           kind, str(requests)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} client failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--serve-args", default="--weights int4")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"aiohttp": [], "httpx": []}
    with tempfile.TemporaryDirectory() as tmp:
        port = vs.free_port()
        command = [sys.executable, "-m", "app.cli", "serve", "--port", str(port),
                   *shlex.split(args.serve_args)]
        server = Running("servescope", command, None, port, Path(tmp) / "serve.log")
        try:
            server.wait_healthy()
            client_run(server, "aiohttp", 2)  # warm-up
            for i in range(args.rounds):
                for kind in ("aiohttp", "httpx") if i % 2 == 0 else ("httpx", "aiohttp"):
                    runs[kind].append(client_run(server, kind, args.requests))
        finally:
            server.stop()
    median = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
              for kind, rs in runs.items()}
    print(json.dumps({
        "benchmark": "loadgen_client", "machine": machine(), "serve_args": args.serve_args,
        "load": {"requests_per_round": args.requests, "concurrency": 1, "input_words": 64,
                 "output_tokens": 64},
        "median": median, "rounds": runs,
        "served_tok_s_aiohttp_over_httpx": statistics.median(
            a["tok_s"] / h["tok_s"] for a, h in zip(runs["aiohttp"], runs["httpx"],
                                                    strict=True)),
        "client_cpu_aiohttp_over_httpx": median["aiohttp"]["cpu_ms_per_token"]
        / median["httpx"]["cpu_ms_per_token"]}, indent=1))


if __name__ == "__main__":
    main()
