"""The monitor's histogram percentiles beside a load test's exact ones, over the same requests.

Against a running OpenAI-compatible server with vLLM's /metrics (real vLLM, or `servescope
serve`): scrape its /metrics, run a Poisson load test, wait until it is idle, scrape again. The
monitor's p50/p95/p99 of TTFT, TPOT and ITL come from the bucket increases between the two
scrapes (Prometheus' histogram_quantile, as the monitor computes them); each is printed with the
bucket interval it lies in, beside the client's exact value, and whether that lies inside.
(The client's clock also counts the network and HTTP stack, so its values sit a little higher.)

    .venv/bin/python benchmarks/monitor_vs_client.py --url http://127.0.0.1:8000 --model demo
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from monitor.loadgen import LoadSpec, run_load  # noqa: E402
from monitor.promtext import parse_metrics  # noqa: E402
from monitor.quantiles import bucket_deltas, histogram_quantile, sum_by_le  # noqa: E402

FAMILIES = {"ttft": "vllm:time_to_first_token_seconds",
            "tpot": "vllm:request_time_per_output_token_seconds",
            "itl": "vllm:inter_token_latency_seconds"}
QUANTILES = (0.5, 0.95, 0.99)


def buckets(text: str, family: str) -> dict[tuple, dict[float, float]]:
    out: dict[tuple, dict[float, float]] = {}
    for labels, value in parse_metrics(text).values(family + "_bucket"):
        rest = tuple(p for p in labels if p[0] != "le")
        out.setdefault(rest, {})[float(dict(labels)["le"])] = value
    return out


def interval(q: float, merged: list[tuple[float, float]]) -> tuple[float, float]:
    """The bucket (lower, upper] the q-quantile's rank falls in."""
    rank, lower = q * merged[-1][1], 0.0
    for bound, count in merged:
        if count >= rank:
            return lower, bound
        lower = bound
    return lower, math.inf


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        scrape = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        busy = sum(v for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
                   for _, v in scrape.values(name))
        if busy == 0:
            return
        time.sleep(0.5)
    raise SystemExit(f"{url} stayed busy for {timeout_s:g} s")


def exact(records, kind: str) -> np.ndarray:
    if kind == "itl":
        return np.array([x for r in records if r.ok for x in r.itl_s])
    return np.array([getattr(r, f"{kind}_s") for r in records
                     if r.ok and getattr(r, f"{kind}_s") is not None])


def compare(url: str, spec: LoadSpec) -> dict:
    wait_idle(url)
    before = httpx.get(url + "/metrics", timeout=10).text
    result = run_load(spec)
    wait_idle(url)
    after = httpx.get(url + "/metrics", timeout=10).text
    rows = {}
    for kind, family in FAMILIES.items():
        a, b = buckets(before, family), buckets(after, family)
        merged = sum_by_le(bucket_deltas(a.get(k, {}), v) for k, v in b.items())
        values = exact(result.records, kind)
        if not merged or merged[-1][1] <= 0:
            rows[kind] = "not exposed by this server"
            continue
        for q in QUANTILES:
            est = histogram_quantile(q, merged)
            lo, hi = interval(q, merged)
            true = float(np.quantile(values, q)) if len(values) else math.nan
            rows[f"{kind}_p{round(q * 100)}"] = {
                "monitor_ms": round(est * 1000, 2), "interval_ms": [lo * 1000, hi * 1000],
                "client_ms": round(true * 1000, 2), "inside": lo <= true <= hi}
    return {"requests": spec.requests, "completed": result.summary["completed"],
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    url = args.url.rstrip("/")
    spec = LoadSpec(url=url, model=args.model, rate=args.rate, requests=args.requests,
                    input_len=args.input_len, output_len=args.output_len, seed=0)
    try:
        server = httpx.get(url + "/version", timeout=5).json().get("version", "")
    except (httpx.HTTPError, ValueError):
        server = ""
    out = compare(url, spec)
    print(json.dumps({"machine": {"platform": platform.platform(),
                                  "processor": platform.processor() or platform.machine(),
                                  "python": platform.python_version()},
                      "server": {"url": url, "version": server}, **out}, indent=1))


if __name__ == "__main__":
    main()
