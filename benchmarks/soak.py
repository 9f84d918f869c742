"""Soak test of `servescope serve`: many requests at high concurrency, hostile ones mixed in.

Starts the real CLI (`python -m app.cli serve`, the demo model) as a subprocess on 127.0.0.1 and
runs two phases against it with the same client, alternating in blocks so that whatever else
runs on the machine falls on both alike: a baseline of valid streaming requests only, and the
same number with a share of hostile requests (bad fields, malformed JSON, oversized and trickled
bodies) mixed in. It reports, in one JSON object:

- valid requests sent, completed by the client, and counted by the server's
  `vllm:request_success_total` (none may be lost: the three must agree);
- hostile requests and how many got a 4xx (all must);
- the server's resident memory at start, after warm-up (one block of each phase) and at the end;
- p50/p99 TTFT of the valid requests (client clock, first content chunk) in each phase, and
  the ratio mixed / baseline.

    python benchmarks/soak.py                  # 10,000 requests a phase at concurrency 64
    python benchmarks/soak.py --requests 1000  # a quicker run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ERRORS: dict[str, int] = {}  # why valid requests did not complete, by kind
PROMPTS = ["The capital of France is", "Write one word about the sea:", "def add(a, b):",
           "Water boils at", "Name a colour:", "Once upon a time", "2 + 2 ="]
HOSTILE = [
    b'{"prompt": "hi \\ud800"}', b'{"prompt": "hi", "seed": 1180591620717411303424}',
    b'{"prompt": "hi", "top_k": 1e30}', b'{"prompt": "hi", "stop": [1]}',
    b'{"prompt": "hi", "max_tokens": 1000000000000}', b'{"prompt": "hi", "max_tokens": 0}',
    b'{"prompt": [999999999]}', b'{"messages": [{"role": "wizard"}]}', b"{not json",
    b"[" * 5000 + b"]" * 5000, b'{"prompt": "hi", "temperature": NaN}', b"\xff\xfe garbage",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def _start_server(port: int, max_num_seqs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--max-num-seqs",
           str(max_num_seqs)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"servescope serve exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("servescope serve did not start within 300 s")


def _success_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


async def _valid(client: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> float | None:
    """One streaming completion; its TTFT in seconds, or None if it did not complete."""
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0.7,
            "seed": rng.randrange(1 << 30), "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    ttft, done = None, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                ERRORS[f"HTTP {r.status_code}"] = ERRORS.get(f"HTTP {r.status_code}", 0) + 1
                return None
            async for line in r.aiter_lines():
                if line.startswith("data: {") and ttft is None:
                    ttft = time.perf_counter() - start
                if line == "data: [DONE]":
                    done = True
    except httpx.HTTPError as exc:
        ERRORS[type(exc).__name__] = ERRORS.get(type(exc).__name__, 0) + 1
        return None
    if not done:
        ERRORS["stream ended without [DONE]"] = ERRORS.get("stream ended without [DONE]", 0) + 1
    return ttft if done else None


async def _hostile(client: httpx.AsyncClient, rng: random.Random, url: str) -> bool:
    """One hostile request; True if it got a 4xx answer."""
    kind = rng.random()
    try:
        if kind < 0.1:  # a body over the limit
            r = await client.post("/v1/completions", content=b"x" * (5 << 20))
        elif kind < 0.15:  # a body that stops halfway: the server cuts it off (408)
            return await _trickle(url)
        else:
            r = await client.post("/v1/completions", content=rng.choice(HOSTILE),
                                  headers={"Content-Type": "application/json"})
    except httpx.HTTPError:
        return False
    return 400 <= r.status_code < 500


async def _trickle(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    await writer.drain()
    try:
        line = await asyncio.wait_for(reader.readline(), 60)
    finally:
        writer.close()
    return line.startswith(b"HTTP/1.1 4")


async def _block(url: str, n: int, concurrency: int, hostile_share: float, max_tokens: int,
                 seed: int, into: dict) -> None:
    """n requests at `concurrency`, a share of them hostile; counts and TTFTs added to `into`."""
    rng = random.Random(seed)
    plan = [rng.random() < hostile_share for _ in range(n)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    next_index = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(worker_seed: int) -> None:
            nonlocal next_index
            wrng = random.Random(worker_seed)
            while next_index < n:
                i = next_index
                next_index += 1
                if plan[i]:
                    into["hostile_sent"] += 1
                    answered = await _hostile(client, wrng, url)
                    into["hostile_4xx"] += answered
                else:
                    into["valid_sent"] += 1
                    ttft = await _valid(client, wrng, max_tokens)
                    if ttft is not None:
                        into["valid_completed"] += 1
                        into["ttfts"].append(ttft)

        start = time.perf_counter()
        await asyncio.gather(*(worker(seed * 1000 + w) for w in range(concurrency)))
        into["wall_s"] += time.perf_counter() - start


def _phase_summary(phase: dict) -> dict:
    t = np.array(phase.pop("ttfts")) * 1000
    return phase | {"wall_s": round(phase["wall_s"], 1),
                    "ttft_ms_p50": round(float(np.percentile(t, 50)), 1),
                    "ttft_ms_p99": round(float(np.percentile(t, 99)), 1)}


def _new_phase() -> dict:
    return {"valid_sent": 0, "valid_completed": 0, "hostile_sent": 0, "hostile_4xx": 0,
            "server_counted": 0, "ttfts": [], "wall_s": 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000, help="requests per phase")
    p.add_argument("--blocks", type=int, default=10,
                   help="the phases alternate in this many blocks each, so that other load on "
                        "the machine falls on both alike")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--hostile", type=float, default=0.05, help="share of hostile requests")
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(port, args.concurrency)
    phases = {"baseline": _new_phase(), "with_hostile": _new_phase()}
    shares = {"baseline": 0.0, "with_hostile": args.hostile}
    per_block = max(1, args.requests // args.blocks)
    try:
        rss = {"start_mb": _rss_mb(proc.pid)}
        for b in range(args.blocks):
            for name, phase in phases.items():
                before = _success_count(url)
                asyncio.run(_block(url, per_block, args.concurrency, shares[name],
                                   args.max_tokens, 2 * b + (name != "baseline"), phase))
                phase["server_counted"] += int(_success_count(url) - before)
            rss.setdefault("per_block_mb", []).append(round(_rss_mb(proc.pid), 1))
            if b == 0:
                rss["after_warmup_mb"] = _rss_mb(proc.pid)  # one block of each phase
        rss["end_mb"] = _rss_mb(proc.pid)
        alive = httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    base, mixed = (_phase_summary(phases[k]) for k in ("baseline", "with_hostile"))
    result = {
        "benchmark": "soak",
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "config": vars(args),
        "baseline": base,
        "with_hostile": mixed,
        "rss_mb": {k: v if isinstance(v, list) else round(v, 1) for k, v in rss.items()},
        "valid_errors": ERRORS,
        "valid_lost": sum(ph["valid_sent"] - ph["valid_completed"] for ph in (base, mixed)),
        "server_count_matches_client": all(ph["server_counted"] == ph["valid_completed"]
                                           for ph in (base, mixed)),
        "hostile_all_4xx": mixed["hostile_4xx"] == mixed["hostile_sent"],
        "rss_end_over_after_warmup": round(rss["end_mb"] / rss["after_warmup_mb"], 3),
        "ttft_p99_ratio_hostile_over_baseline": round(mixed["ttft_ms_p99"]
                                                      / base["ttft_ms_p99"], 3),
        "server_alive_after": alive,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
