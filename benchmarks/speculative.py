"""Speculative decoding: tokens/s with and without it on copy-heavy and open-chat prompts, as JSON.

Same engine build, same prompts, greedy (temperature 0): the outputs with and without
speculation are checked equal token for token, so the speed-up is lossless by construction.
Workloads: copy-heavy chat, open chat, replies the drafts cannot predict (shuffled words: where
speculation must not lose), and 16 open-chat requests at once (where verification competes with
the batch for the same compute).
Each proposer is measured beside its own baseline (the machine's load drifts): one prompt at a
time, the two engines take each prompt in turns; the concurrent batch runs side after side.
`speedup` is over whole requests, the prompt's prefill included; `decode_speedup` (one prompt at a
time) over the decode phase alone, after each reply's first token: speculation does not change
the prefill, which on the 2-core CPU is 40% of a copy-heavy request under speculation.
With --rounds N each workload is compared N times in a row and the median round reported (the
shared machine's load moves single rounds by 10% or more); the concurrent workload alternates
CONCURRENT_PAIRS times within each round, and a control (a second engine without speculation,
measured the same way) shows how far the machine's noise alone moves that figure.
Run: python benchmarks/speculative.py [--spec ngram --spec demo-draft ...] [--max-tokens 128]
     [--rounds 3] [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this folder comes first on sys.path and this file's neighbours could shadow
# the project's packages.
sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

PASSAGE = (
    "The city council met on Tuesday to discuss the new bike lanes on Main Street. Residents "
    "said the lanes made the street safer for children walking to school, but shop owners "
    "worried that fewer parking spaces would hurt their business. After a long debate, the "
    "council agreed to keep the lanes for six months and to count visitors to the shops."
)
TYPOS = PASSAGE.replace("the", "teh", 2)
COPY_HEAVY = [
    f"Fix the spelling in this text and return it unchanged otherwise:\n\n{TYPOS}",
    f"Repeat the following paragraph exactly, then stop:\n\n{PASSAGE}",
    f"Rewrite this paragraph in the past tense, keeping every other word:\n\n{PASSAGE}",
    f"Quote the first two sentences of this text:\n\n{PASSAGE}",
]


def _shuffled(n_prompts: int, n_words: int = 48) -> list[str]:
    """Prompts whose replies the drafts cannot predict: shuffled words, no sentence to copy."""
    words = sorted(set(PASSAGE.lower().replace(".", "").replace(",", "").split()))
    rng = random.Random(0)
    return ["Continue this list of words with more words, in no order: "
            + " ".join(rng.choice(words) for _ in range(n_words)) for _ in range(n_prompts)]


UNPREDICTABLE = _shuffled(4)
CONCURRENT = 16  # the batch workload: open-chat prompts, all at once
# Its runs alternate this many times a round: one batch takes 2-3 s, and single runs of the
# same engine moved by +-5% on the shared 2-core VM (speculation with drafting switched off
# read 0.91-1.07x), more than the 3% the target allows.
CONCURRENT_PAIRS = 3


def run_batch(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once through the chat template (continuous batching); generated tokens
    per second over the whole batch."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    llm.generate(ids[:2], SamplingParams(temperature=0, max_tokens=4))
    start = time.perf_counter()
    outs = llm.generate(ids, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "outputs": [o.token_ids for o in outs]}


def run_workload(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt alone through the chat template; wall-clock generated tokens per second."""
    _warm(llm)
    return _merged([run_prompt(llm, prompt, max_tokens) for prompt in prompts])


def run_interleaved(plain: LLM, spec: LLM, prompts: list[str], max_tokens: int
                    ) -> tuple[dict, dict]:
    """run_workload on both engines, prompt by prompt in turns (which goes first alternating),
    so a burst of load on the shared machine falls on both sides rather than on one whole
    side's run: single rounds of the copy-heavy workload, run side after side, read 2.7x to
    3.5x for the same engines."""
    _warm(plain)
    _warm(spec)
    base, fast = [], []
    for i, prompt in enumerate(prompts):
        turns = [(plain, base), (spec, fast)]
        for llm, runs in turns if i % 2 == 0 else turns[::-1]:
            runs.append(run_prompt(llm, prompt, max_tokens))
    return _merged(base), _merged(fast)


def _warm(llm: LLM) -> None:
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))


def run_prompt(llm: LLM, prompt: str, max_tokens: int) -> dict:
    """One prompt through the chat template: its tokens, wall-clock seconds and decode phase."""
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}],
                   SamplingParams(temperature=0, max_tokens=max_tokens))
    return {"tokens": len(out.token_ids), "seconds": time.perf_counter() - start,
            "outputs": [out.token_ids],
            "decode_s": out.metrics.finished - out.metrics.first_token}


def _merged(runs: list[dict]) -> dict:
    """Prompts' runs as one: tokens per second over all, and over their decode phases alone
    (after each reply's first token; vLLM's TPOT), which is what speculation changes: the
    whole includes the prompts' prefill, which it does not."""
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "outputs": [o for r in runs for o in r["outputs"]],
            "decode_tokens_per_s": (tokens - len(runs)) / decode_s if decode_s else None}


def batch_pair(plain: LLM, spec: LLM, prompts: list[str], max_tokens: int
               ) -> tuple[dict, dict]:
    """run_batch on the baseline, then on speculation."""
    return run_batch(plain, prompts, max_tokens), run_batch(spec, prompts, max_tokens)


def compare(plain: LLM, spec: LLM, prompts: list[str], max_tokens: int,
            run_pair=run_interleaved, pairs: int = 1) -> dict:
    """Baseline and speculation (`run_pair` runs both), `pairs` times; each side's tokens per
    second over all its runs."""
    before = _counters(spec)
    bases, fasts = [], []
    for _ in range(pairs):
        base, fast = run_pair(plain, spec, prompts, max_tokens)
        bases.append(base)
        fasts.append(fast)
    after = _counters(spec)
    drafts = after["drafts"] - before["drafts"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    nodes = after["draft_nodes"] - before["draft_nodes"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    differences = [d for b, f in zip(bases, fasts, strict=True)
                   for d in first_differences(b["outputs"], f["outputs"])]
    return {
        "prompts": len(prompts), "max_tokens": max_tokens, "pairs": pairs,
        "outputs_identical": not differences,
        # Where replies differed: [prompt index, first differing token], for a hunt (two
        # plain engines of one process disagreed in some runs: the first engine's rotary
        # table, engine/rope.py).
        "differences": differences,
        "baseline_tokens_per_s": _tokens_per_s(bases),
        "speculative_tokens_per_s": _tokens_per_s(fasts),
        "speedup": _tokens_per_s(fasts) / _tokens_per_s(bases),
        # Each reply after its first token (one prompt at a time only; None for the batch).
        "decode_speedup": _decode_speedup(bases, fasts),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        # Tree nodes verified per draft position (1: chains only).
        "nodes_per_level": nodes / draft_tokens if draft_tokens else None,
        "generated_tokens": sum(f["tokens"] for f in fasts),
    }


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """[prompt index, index of the first token that differs] for each reply that differs."""
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            same = (s == t for s, t in zip(x, y, strict=False))  # up to the shorter reply
            out.append([i, next((j for j, eq in enumerate(same) if not eq),
                                min(len(x), len(y)))])
    return out


def _decode_speedup(bases: list[dict], fasts: list[dict]) -> float | None:
    """Speculation's decode-phase tokens/s over the baseline's (median over the pairs)."""
    ratios = [f["decode_tokens_per_s"] / b["decode_tokens_per_s"]
              for b, f in zip(bases, fasts, strict=True)
              if b.get("decode_tokens_per_s") and f.get("decode_tokens_per_s")]
    return statistics.median(ratios) if ratios else None


def _tokens_per_s(runs: list[dict]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def _counters(llm: LLM) -> dict:
    """The speculative counters compare() reads (zeros for an engine without speculation: the
    control, a second plain engine)."""
    if llm.spec is None:
        return dict.fromkeys(("drafts", "draft_tokens", "draft_nodes", "accepted_tokens"), 0)
    return dict(llm.spec.summary())


def compare_rounds(plain: LLM, spec: LLM, prompts: list[str], max_tokens: int, rounds: int,
                   run_pair=run_interleaved, pairs: int = 1) -> dict:
    """compare() `rounds` times in a row: the round with the median speed-up (the lower of
    the middle two for an even count; its decode_speedup is that round's), every round's
    speed-up and decode-phase speed-up beside it, outputs identical in all, and each round's
    differences (compare's [prompt, first differing token] list)."""
    results = [compare(plain, spec, prompts, max_tokens, run_pair, pairs)
               for _ in range(rounds)]
    median = sorted(results, key=lambda r: r["speedup"])[(len(results) - 1) // 2]
    return {**median, "outputs_identical": all(r["outputs_identical"] for r in results),
            "differences": [r["differences"] for r in results],
            "speedups": [round(r["speedup"], 3) for r in results],
            "decode_speedups": [r["decode_speedup"] and round(r["decode_speedup"], 3)
                                for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--spec", action="append",
                        help="a proposer to measure (repeatable); default: ngram, demo-draft "
                             "(after prompt lookup), demo-draft:lookup=0 (the draft alone) and "
                             "demo-medusa:lookup=0 (the Medusa heads alone)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto",
                        help="weights' dtype: auto (the engine's default: bfloat16 on CPUs "
                             "with bfloat16 instructions, else float32), float32 or bfloat16")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds per workload (the median speed-up is reported)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds needs at least 1 round")
    specs = args.spec or ["ngram", "demo-draft", "demo-draft:lookup=0", "demo-medusa:lookup=0"]
    model = args.model or str(fetch_demo_model(progress=lambda m, f: None))
    plain = LLM(model, device="cpu", dtype=args.dtype)
    runs = {}
    # The control: a second engine without speculation against the first, measured as each
    # proposer is. How far its "speed-up" strays from 1 is what this machine's noise alone
    # does to the concurrent workload's figure.
    print(f"control: {CONCURRENT} concurrent requests, two plain engines", file=sys.stderr)
    twin = LLM(model, device="cpu", dtype=args.dtype)
    control = compare_rounds(plain, twin, (OPEN_CHAT * CONCURRENT)[:CONCURRENT],
                             args.max_tokens, args.rounds, batch_pair, CONCURRENT_PAIRS)
    twin.close()
    for name in specs:
        spec = LLM(model, device="cpu", dtype=args.dtype, speculative=name)
        print(f"{name}: copy-heavy workload", file=sys.stderr)
        copy = compare_rounds(plain, spec, COPY_HEAVY, args.max_tokens, args.rounds)
        print(f"{name}: open chat workload", file=sys.stderr)
        chat = compare_rounds(plain, spec, OPEN_CHAT, args.max_tokens, args.rounds)
        print(f"{name}: unpredictable workload", file=sys.stderr)
        noise = compare_rounds(plain, spec, UNPREDICTABLE, args.max_tokens, args.rounds)
        print(f"{name}: {CONCURRENT} concurrent requests", file=sys.stderr)
        batch = compare_rounds(plain, spec, (OPEN_CHAT * CONCURRENT)[:CONCURRENT],
                               args.max_tokens, args.rounds, batch_pair, CONCURRENT_PAIRS)
        summary = spec.spec.summary()
        runs[name] = {"copy_heavy": copy, "open_chat": chat, "unpredictable": noise,
                      f"concurrent_{CONCURRENT}": batch,
                      "step_ms_by_tokens": summary["step_ms_by_tokens"],
                      "draft_token_ms": summary["draft_token_ms"]}
        spec.close()
    workloads = ("copy_heavy", "open_chat", "unpredictable", f"concurrent_{CONCURRENT}")
    targets = {"outputs_identical": all(r[w]["outputs_identical"] for r in runs.values()
                                        for w in workloads)}
    for name, r in runs.items():
        targets[f"{name}_unpredictable_ge_0_97"] = r["unpredictable"]["speedup"] >= 0.97
        targets[f"{name}_concurrent_not_slower"] = \
            r[f"concurrent_{CONCURRENT}"]["speedup"] >= 0.97
    if "ngram" in runs:
        targets["ngram_copy_heavy_speedup_ge_2"] = runs["ngram"]["copy_heavy"]["speedup"] >= 2.0
    for name in (n for n in runs if n.startswith("ngram")):
        # The copy-heavy target (prompt lookup, any draft length).
        targets[f"{name}_copy_heavy_speedup_ge_3_5"] = runs[name]["copy_heavy"]["speedup"] >= 3.5
    for name in (n for n in runs if n.startswith("demo-")):
        targets[f"{name}_open_chat_speedup_ge_1_3"] = runs[name]["open_chat"]["speedup"] >= 1.3
        if "branches=" in name and "lookup=0" in name:  # a trained proposer alone, with trees
            targets[f"{name}_open_chat_speedup_ge_1_5"] = \
                runs[name]["open_chat"]["speedup"] >= 1.5
    result = {
        "benchmark": "speculative_decoding", "model": plain.model_name,
        "dtype": plain.dtype, "temperature": 0, "machine": machine(), "runs": runs,
        f"control_concurrent_{CONCURRENT}": control,
        "targets": targets,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
