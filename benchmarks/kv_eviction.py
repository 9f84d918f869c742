"""KV-cache eviction: quality and memory of every policy at 10/20/40/80% budgets, and
StreamingLLM running past the context length.

One JSON object. Part 1 (`sweep`): the demo model reads 3,072 tokens of English (the Python
Language Reference, assets/texts/): the first 1,024 are the prompt, the other 2,048 are decoded
one at a time with the true token forced in. Every (policy, budget) runs in the same batch as
the full cache, so each row's perplexity, top-1 agreement and KV memory are ratios against the
full cache of the same run. Part 2 (`streaming_past_context`): an engine whose context is 1,024
tokens reads the same 3,072 tokens (3x its context) with StreamingLLM at a 512-token budget;
perplexity per half-context window of the continuation (stable = no blow-up) and the KV tokens
held (constant), against the full cache's perplexity on the part that fits in the context.
Run: python benchmarks/kv_eviction.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.kv_eval import evaluate_policies  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "assets" / "texts" / "python-reference.txt"
POLICIES = ("streaming", "h2o", "scissorhands", "snapkv")
BUDGETS = (0.1, 0.2, 0.4, 0.8)


def sweep(model: str, ids: list[int], prompt_len: int) -> dict:
    configs = [(p, b) for p in POLICIES for b in BUDGETS]
    # Room for StreamingLLM at 80%: budget + a block + a 512-token chunk stays inside the context.
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=len(ids) + 512 + 64,
              max_num_seqs=len(configs) + 1, max_num_batched_tokens=512,
              kv_cache_tokens=len(ids) * 8)
    per_token = llm.config.kv_bytes_per_token(llm.runner.kv.element_size())
    start = time.perf_counter()
    scores = evaluate_policies(llm, ids, prompt_len, configs)
    seconds = time.perf_counter() - start
    full = scores[0]
    rows = []
    for s in scores:
        row = s.as_dict()
        row["perplexity_ratio"] = s.perplexity / full.perplexity
        row["peak_kv_mib"] = s.peak_kv_tokens * per_token / 2**20
        row["kv_memory_ratio"] = s.peak_kv_tokens / full.peak_kv_tokens
        rows.append(row)
    h2o_20 = next(r for r in rows if r["policy"] == "h2o" and r["budget"] == 0.2)
    return {"text_tokens": len(ids), "prompt_tokens": prompt_len,
            "scored_tokens": len(ids) - prompt_len, "seconds": seconds,
            "full_cache_perplexity": full.perplexity,
            "h2o_20pct_perplexity_ratio": h2o_20["perplexity_ratio"],
            "h2o_20pct_within_10pct": h2o_20["perplexity_ratio"] <= 1.10,
            "rows": rows}


def streaming_past_context(model: str, ids: list[int], context: int) -> dict:
    budget, prompt_len, window = context // 2, context // 4, context // 2
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=context,
              max_num_batched_tokens=context // 4,
              kv_cache_tokens=context * 4)
    start = time.perf_counter()
    stream = evaluate_policies(llm, ids[: context - 1], prompt_len, [("streaming", budget)])
    # The full cache can only read what fits in the context: its perplexity there is the bar.
    fits = stream[0]
    held = []
    params = SamplingParams(temperature=0.0, max_tokens=len(ids) - prompt_len, ignore_eos=True,
                            kv_policy="streaming", kv_budget=budget)
    seq = llm.sequence(llm.add_request(ids[:prompt_len], params, forced_tokens=ids[prompt_len:]))
    while not seq.is_finished:
        llm.step()
        if not seq.is_finished:
            held.append(seq.kv_len)
    lps = seq.forced.logprobs
    windows = [math.exp(-sum(lps[i : i + window]) / len(lps[i : i + window]))
               for i in range(0, len(lps) - window + 1, window)]
    return {"context_length": context, "text_tokens": len(ids), "text_over_context": len(ids) /
            context, "budget_tokens": budget, "prompt_tokens": prompt_len,
            "seconds": time.perf_counter() - start,
            "full_cache_perplexity_within_context": fits.perplexity,
            "streaming_perplexity_within_context": stream[1].perplexity,
            "window_tokens": window, "streaming_perplexity_per_window": windows,
            "streaming_perplexity_whole_text": math.exp(-sum(lps) / len(lps)),
            "last_window_over_full_cache": windows[-1] / fits.perplexity,
            "kv_tokens_held_max": max(held), "kv_tokens_held_at_end": held[-1],
            "kv_tokens_held_after_first_context": max(held[context:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 768-token text (smoke run)")
    args = parser.parse_args()
    model = str(fetch_demo_model(progress=lambda m, f: None))
    text_len = 768 if args.quick else 3072
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_tokens=256)
    ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:text_len]
    del llm
    result = {"benchmark": "kv_eviction", "model": "SmolLM2-135M-Instruct Q4_1 (float32)",
              "machine": machine(), "sweep": sweep(model, ids, text_len // 3),
              "streaming_past_context": streaming_past_context(model, ids, text_len // 3)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
