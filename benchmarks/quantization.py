"""Quantization quality on the demo model: weights and KV cache; perplexity, greedy agreement,
memory.

Perplexity of float32, int8 and int4 (groups of 32 / 64 / 128) weights over Chapter I of
"Alice's Adventures in Wonderland" (Lewis Carroll, 1865; public domain, Project Gutenberg
eBook #11; benchmarks/data/alice_chapter1.txt, ~2,900 tokens) in one pass; greedy replies of
each quantized engine against float32 on the same chat prompts; weight bytes of each. Then the
same for an int8 and an fp8 KV cache (float32 weights) against the float32 cache, with the KV
bytes per token and the decode throughput of concurrent long requests in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where benchmarks/engine.py would
# shadow the `engine` package; drop that entry before importing it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine, measure_throughput  # noqa: E402

TEXT = _HERE / "data" / "alice_chapter1.txt"
FORMATS = ("float", "int8", "int4:g32", "int4:g64", "int4:g128")
TARGETS = {"int8": 0.02, "int4:g32": 0.08}  # perplexity within this fraction of float32
# The same formats through the reference kernels (dequantize, then a float32 matmul): what the
# packed ops' bfloat16 activations cost, apart from the weights themselves.
REFERENCE_RUNS = ("int8", "int4:g32")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in one sentence what a CPU does.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a tip for sleeping better.",
    "What language is spoken in Brazil?",
    "Describe a cat in two sentences.",
    "Why is the sky blue?",
    "List the days of the week.",
    "What is photosynthesis?",
    "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
    "What does HTTP stand for?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
)


def log(message: str) -> None:
    print(f"[quantization] {message}", file=sys.stderr, flush=True)


def perplexity(llm: LLM, ids: list[int]) -> dict:
    """exp(mean negative log-likelihood) of every token after the first, in one prefill."""
    logits = llm.prompt_logits(ids)
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return {"perplexity": math.exp(nll), "nll_per_token": nll}


def greedy_replies(llm: LLM, prompts: tuple[str, ...], tokens: int) -> list[list[int]]:
    chats = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    outputs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=tokens))
    return [o.token_ids for o in outputs]


def agreement(replies: list[list[int]], reference: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(replies, reference, strict=True))
    prefix = [_common_prefix(a, b) / max(len(b), 1) for a, b in zip(replies, reference,
                                                                       strict=True)]
    return {"identical_replies": same, "of": len(reference),
            "mean_common_prefix_fraction": sum(prefix) / len(prefix)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(model: str, fmt: str, text: str, max_text_tokens: int | None,
            prompts: tuple[str, ...], tokens: int, backend: str | None = None,
            kv_cache_dtype: str = "auto",
            dtype: str = "float32") -> tuple[dict, list[list[int]], int]:
    log(f"{fmt}: loading" + (f" with the {backend} kernels" if backend else "")
        + (f" and an {kv_cache_dtype} KV cache" if kv_cache_dtype != "auto" else ""))
    start = time.perf_counter()
    llm = LLM(model, device="cpu", dtype=dtype, weights=fmt, kv_cache_tokens=8192,
              kernel_backend=backend, kv_cache_dtype=kv_cache_dtype)
    ids = llm.tokenizer.encode(text)[:max_text_tokens]
    row = {"weights": llm.weights, "load_s": time.perf_counter() - start,
           "weight_bytes": llm.weight_bytes,
           "matrices_from_gguf_blocks": llm.model.weights_from_gguf_blocks,
           "linear_kernel": type(llm.model.layers[0].qkv).__name__,
           "kv_cache_dtype": llm.kv_cache_dtype,
           "kv_bytes_per_token": llm.kv_bytes_per_token}
    log(f"{fmt}: perplexity over {len(ids)} tokens")
    row.update(perplexity(llm, ids))
    log(f"{fmt}: greedy replies to {len(prompts)} prompts")
    replies = greedy_replies(llm, prompts, tokens)
    llm.close()
    del llm
    gc.collect()
    return row, replies, len(ids)


def run(model: str | None, quick: bool) -> dict:
    from engine.models import fetch_demo_model, resolve_model

    path = str(resolve_model(model) if model else fetch_demo_model(lambda m, f: None))
    text = TEXT.read_text(encoding="utf-8")
    prompts, tokens = (PROMPTS[:4], 16) if quick else (PROMPTS, 48)
    rows: dict[str, dict] = {}
    replies: dict[str, list[list[int]]] = {}
    for fmt in FORMATS:
        rows[fmt], replies[fmt], text_tokens = measure(path, fmt, text, 512 if quick else None,
                                                       prompts, tokens)
    base = rows["float"]
    for fmt, row in rows.items():
        row["perplexity_vs_float32"] = row["perplexity"] / base["perplexity"]
        row["weight_bytes_vs_float32"] = row["weight_bytes"] / base["weight_bytes"]
        if fmt != "float":
            row["greedy_vs_float32"] = agreement(replies[fmt], replies["float"])
    reference = {}
    for fmt in REFERENCE_RUNS:
        row, fmt_replies, _ = measure(path, fmt, text, 512 if quick else None, prompts, tokens,
                                      "reference")
        row["perplexity_vs_float32"] = row["perplexity"] / base["perplexity"]
        row["greedy_vs_float32"] = agreement(fmt_replies, replies["float"])
        reference[fmt] = row
    # How sensitive greedy agreement is: bfloat16 weights and activations, no quantization.
    row, bf16_replies, _ = measure(path, "float", text, 512 if quick else None, prompts, tokens,
                                   "reference", dtype="bfloat16")
    row["perplexity_vs_float32"] = row["perplexity"] / base["perplexity"]
    row["greedy_vs_float32"] = agreement(bf16_replies, replies["float"])
    kv = kv_cache_rows(path, text, 512 if quick else None, prompts, tokens, replies["float"],
                       base, quick)
    return {
        "benchmark": "quantization", "quick": quick, "model_path": path,
        "device": "cpu", "activations": "float32 (bfloat16 inside the packed int8/int4 ops)",
        "machine": machine(), "load_average_1_5_15_min": os.getloadavg(),
        "text": {"file": str(TEXT.relative_to(_HERE.parent)), "tokens": text_tokens,
                 "source": "Lewis Carroll, Alice's Adventures in Wonderland, Chapter I "
                           "(Project Gutenberg eBook #11, public domain)"},
        "greedy": {"prompts": len(prompts), "max_tokens": tokens,
                   "method": "chat template, temperature 0, token ids compared with float32's"},
        "formats": rows,
        "float32_activations_reference_kernels": reference,
        "bfloat16_unquantized_baseline": row,
        "lm_head": "int8 per output channel under every quantized format; embedding and norms "
                   "float32",
        "kv_cache": kv,
        "targets": {f"{fmt}_perplexity_within_{int(limit * 100)}pct":
                    rows[fmt]["perplexity_vs_float32"] <= 1 + limit
                    for fmt, limit in TARGETS.items()},
        "finished_at": time.time(),
    }


def kv_cache_rows(path: str, text: str, max_text_tokens: int | None, prompts: tuple[str, ...],
                  tokens: int, float_replies: list[list[int]], base: dict, quick: bool) -> dict:
    """Each KV cache dtype with float32 weights: quality against the float32 cache (the float
    weights' row above: the same engine), memory per token, and concurrent decode speed."""
    rows = {"auto": {k: base[k] for k in ("perplexity", "kv_cache_dtype", "kv_bytes_per_token")}}
    for kv in KV_CACHE_DTYPES[1:]:
        row, kv_replies, _ = measure(path, "float", text, max_text_tokens, prompts, tokens,
                                     kv_cache_dtype=kv)
        rows[kv] = {k: row[k] for k in ("perplexity", "kv_cache_dtype", "kv_bytes_per_token")}
        rows[kv]["greedy_vs_float32_cache"] = agreement(kv_replies, float_replies)
    concurrency, prompt_tokens, new_tokens = (4, 256, 8) if quick else (8, 1024, 32)
    for kv in KV_CACHE_DTYPES:
        rows[kv]["perplexity_vs_float32_cache"] = rows[kv]["perplexity"] / base["perplexity"]
        rows[kv]["kv_bytes_vs_float32_cache"] = (rows[kv]["kv_bytes_per_token"]
                                                 / base["kv_bytes_per_token"])
        log(f"{kv} KV cache: {concurrency} concurrent requests of {prompt_tokens} tokens")
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=16384,
                  kv_cache_dtype=kv)
        rows[kv]["concurrent_tokens_per_s"] = measure_throughput(llm, concurrency,
                                                                 prompt_tokens, new_tokens)
        llm.close()
        gc.collect()
    for kv in KV_CACHE_DTYPES:
        rows[kv]["concurrent_speed_vs_float32_cache"] = (
            rows[kv]["concurrent_tokens_per_s"] / rows["auto"]["concurrent_tokens_per_s"])
    return {"dtypes": rows,
            "scales": "float32, one per token and KV head (kernels/kv_quant.py)",
            "speed": {"concurrency": concurrency, "prompt_tokens": prompt_tokens,
                      "new_tokens": new_tokens, "method": "engine.bench.measure_throughput: "
                      "generated tokens per second, prefill included"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="512 tokens and 4 prompts, a smoke run (not the targets' sizes)")
    parser.add_argument("--model", help="a GGUF path (default: the demo model)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.model, args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
