"""Prefix caching: TTFT and throughput of requests sharing a long system prompt, with and
without the cache.

One JSON object: the same engine build run twice over the same requests, greedy, outputs checked
identical. Part 1: a ~2,000-token system prompt, then 16 different questions, each sent alone
after the previous finished (as chat turns arrive): mean and median TTFT. Part 2: the 16
requests at once (16 concurrent): wall time and generated tokens/s, after one request has
warmed the cache (the steady state of a chat server).
Run: python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

SYSTEM = (
    "You are the support assistant of a bicycle shop. The shop sells city bikes, road bikes, "
    "mountain bikes and electric bikes, rents bikes by the hour or day, repairs flat tires, "
    "adjusts brakes and gears, and offers a yearly service plan. Opening hours are 9 to 18 on "
    "weekdays and 10 to 16 on Saturdays; the shop is closed on Sundays. Answer briefly, be "
    "friendly, and never invent prices. "
) * 22
QUESTIONS = ["Do you rent electric bikes?", "When are you open on Saturday?",
             "Can you fix a flat tire today?", "What is included in the service plan?",
             "Do you sell kids' bikes?", "Are you open on Sunday?",
             "Can I rent a road bike for a week?", "Do you adjust gears?",
             "How much is a yearly service plan?", "Can I bring my own bike for repair?",
             "Do you have helmets?", "Is there parking near the shop?",
             "Can I rent a mountain bike for a day?", "Do you repair electric bikes?",
             "What time do you close on weekdays?", "Do you sell used bikes?"]


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def run(llm: LLM) -> tuple[list[float], list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=16)
    ttfts, outputs = [], []
    for q in QUESTIONS:
        out = llm.chat(_messages(q), params)
        ttfts.append(out.metrics.ttft_s)
        outputs.append(out.token_ids)
    return ttfts, outputs


def run_concurrent(llm: LLM) -> tuple[float, int, list[list[int]]]:
    """All questions at once; (wall seconds, tokens generated, outputs)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [llm.chat_prompt(_messages(q)) for q in QUESTIONS]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))  # warm the cache
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, sum(len(o.token_ids) for o in outs), [o.token_ids for o in outs]


def main() -> int:
    model = str(fetch_demo_model(progress=lambda m, f: None))
    plain = LLM(model, device="cpu", dtype="float32", kv_cache_tokens=65536, max_num_seqs=16)
    cached = LLM(model, device="cpu", dtype="float32", kv_cache_tokens=65536, max_num_seqs=16,
                 prefix_caching=True)
    for llm in (plain, cached):  # warm-up on an unrelated prompt
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))
    base_ttft, base_out = run(plain)
    cache_ttft, cache_out = run(cached)
    prompt_tokens = len(plain.chat_prompt([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": QUESTIONS[0]}]))
    # The first request fills the cache; the rest are the steady state a chat server sees.
    base, fast = statistics.median(base_ttft[1:]), statistics.median(cache_ttft[1:])
    base_mean, fast_mean = statistics.mean(base_ttft[1:]), statistics.mean(cache_ttft[1:])
    c = cached.prefix_cache.counters
    base_wall, base_tokens, base_conc = run_concurrent(plain)
    cache_wall, cache_tokens, cache_conc = run_concurrent(cached)
    result = {
        "benchmark": "prefix_cache", "model": plain.model_name, "dtype": plain.dtype,
        "machine": machine(), "requests": len(QUESTIONS), "prompt_tokens": prompt_tokens,
        "outputs_identical": base_out == cache_out and base_conc == cache_conc,
        "ttft_ms_mean_without_cache": base_mean * 1000, "ttft_ms_mean_with_cache": fast_mean * 1000,
        "ttft_mean_reduction_pct": 100 * (1 - fast_mean / base_mean),
        "ttft_ms_median_without_cache": base * 1000, "ttft_ms_median_with_cache": fast * 1000,
        "ttft_speedup": base / fast, "first_request_ttft_ms_with_cache": cache_ttft[0] * 1000,
        "concurrent_requests": len(QUESTIONS),
        "concurrent_tokens_per_s_without_cache": base_tokens / base_wall,
        "concurrent_tokens_per_s_with_cache": cache_tokens / cache_wall,
        "concurrent_throughput_gain": (cache_tokens / cache_wall) / (base_tokens / base_wall),
        "prefix_cache_queries_tokens": c.queries, "prefix_cache_hits_tokens": c.hits,
        "hit_rate": c.hit_rate,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
