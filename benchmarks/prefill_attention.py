"""The CPU's prefill attention kernel (cpu_kernels.c's prefill_attention) against torch's
scaled_dot_product_attention (the path before), alone per layer and in the demo model's real
prefills, alternating in one process.

1. One layer's attention, the demo model's heads (9 query heads, 3 KV heads of 64), bfloat16,
   causal, for chunks of 16 to 2,000 tokens: median microseconds each way.
2. Time to first token of the demo model in bfloat16 (`generate` with max_tokens=1: the prefill
   and one sampled token) for one prompt of about 110 and about 1,000 tokens, and for 16
   prompts of 64 words at once (the served 16-concurrent case's first step): each round runs
   every case with the kernel, then with torch's attention (the kernel switched off as it is
   where it does not run), on fresh random prompts each time, so the prefix cache never hits.
   With the kernel a prefill step's layers are one C call (kernels/cpu_layers.py); without it
   they take the model's layer loop, as before the kernel, so the TTFT ratio is both changes'.

Prints one JSON object: the machine, both sides' figures and the ratios.

    python benchmarks/prefill_attention.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from kernels import cpu_kernels, reference  # noqa: E402
from kernels.metadata import PrefillChunk  # noqa: E402
from monitor.loadgen import make_prompt  # noqa: E402

LAYER_TOKENS = (16, 64, 110, 256, 1000, 2000)
HEADS, KV_HEADS, DIM = 9, 3, 64  # the demo model's attention
SIDES = ("kernel", "torch")
REAL_KERNEL_CHECK = cpu_kernels.prefill_available


def _use(side: str) -> None:
    """Route bfloat16 prefill chunks through the kernel, or through torch's attention (the
    kernel reported unavailable, as on a CPU without AVX512-BF16)."""
    cpu_kernels.prefill_available = REAL_KERNEL_CHECK if side == "kernel" else (lambda: False)


def layer_times(rounds: int) -> dict:
    out = {}
    for n in LAYER_TOKENS:
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(n, HEADS, DIM, generator=gen).to(torch.bfloat16)
        k = torch.randn(n, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
        chunk = PrefillChunk(0, n, torch.arange(n), None, causal=True)
        args = (q, k, v, chunk, DIM ** -0.5)
        calls = {"kernel": lambda a=args: cpu_kernels.prefill_attention(*a),
                 "torch": lambda a=args: reference._prefill_attention(*a)}
        reps = max(3, 2000 // n)
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        for _ in range(rounds):
            for side in SIDES:
                _use(side)
                calls[side]()  # warm
                start = time.perf_counter()
                for _ in range(reps):
                    calls[side]()
                times[side].append((time.perf_counter() - start) / reps * 1e6)
        kernel, torch_us = statistics.median(times["kernel"]), statistics.median(times["torch"])
        flops = HEADS * n * (n + 1) * DIM * 2  # causal: QK^T and PV over n(n+1)/2 pairs
        out[str(n)] = {"kernel_us": round(kernel, 1), "torch_us": round(torch_us, 1),
                       "speedup": round(torch_us / kernel, 2),
                       "kernel_gflops": round(flops / kernel / 1e3, 1),
                       "torch_gflops": round(flops / torch_us / 1e3, 1)}
    _use("kernel")
    return out


def _prompts(llm: LLM, words: int, count: int, rng: np.random.Generator) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": make_prompt(words, rng)}])
            for _ in range(count)]


def ttft(llm: LLM, rounds: int) -> dict:
    """Seconds to the first token, per case and side (median over rounds)."""
    cases = {"one_short_prompt": (80, 1), "one_long_prompt": (760, 1),
             "sixteen_prompts": (64, 16)}
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = np.random.default_rng(0)
    times = {case: {s: [] for s in SIDES} for case in cases}
    tokens: dict[str, list[int]] = {case: [] for case in cases}
    llm.generate(_prompts(llm, 64, 1, rng), params)  # warm-up
    for _ in range(rounds):
        for case, (words, count) in cases.items():
            for side in SIDES:
                _use(side)
                prompts = _prompts(llm, words, count, rng)
                tokens[case].append(sum(len(p) for p in prompts))
                start = time.perf_counter()
                llm.generate(prompts, params)
                times[case][side].append(time.perf_counter() - start)
    _use("kernel")
    out = {}
    for case in cases:
        kernel = statistics.median(times[case]["kernel"])
        torch_s = statistics.median(times[case]["torch"])
        out[case] = {"prompt_tokens": int(statistics.median(tokens[case])),
                     "kernel_ms": round(kernel * 1e3, 1), "torch_ms": round(torch_s * 1e3, 1),
                     "speedup": round(torch_s / kernel, 2),
                     "kernel_rounds_ms": [round(t * 1e3, 1) for t in times[case]["kernel"]],
                     "torch_rounds_ms": [round(t * 1e3, 1) for t in times[case]["torch"]]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not REAL_KERNEL_CHECK():
        raise SystemExit("The prefill attention kernel does not run here (it needs AVX512-BF16 "
                         "and a C compiler; see the log): nothing to compare.")
    llm = LLM(str(fetch_demo_model(progress=lambda m, f: None)), device="cpu",
              dtype="bfloat16")
    result = {"benchmark": "prefill_attention", "model": llm.model_name, "dtype": "bfloat16",
              "machine": machine(), "rounds": args.rounds,
              "layer": layer_times(args.rounds), "ttft": ttft(llm, args.rounds)}
    llm.close()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
