"""The CPU's bfloat16 tile kernel (kernels/cpu_linear.py) against oneDNN's packed bfloat16
matmul (kernels/onednn.py, the path before it), in real engine steps of the demo model and per
layer shape, alternating in one process.

Two engines load the demo model in bfloat16: one with its linears through the tile kernel (the
default where the CPU has AVX512-BF16; on a CPU with AMX, the AMX kernel on the same layout),
one through oneDNN's packed weights. For each batch size
both hold that many requests decoding (64-word prompts, greedy, ignore_eos) and every round runs
a few steps of each in turn, so the machine's load falls on both alike. A prefill of 16 fresh
prompts is timed the same way, then each layer shape's linear at decode and prefill row counts
(both on the same weights), and both engines' greedy replies against float32's. Prints one JSON
object: the machine, the median step times and the ratios.

    python benchmarks/cpu_bf16.py                   # batch 1 and 16, 10 rounds
    python benchmarks/cpu_bf16.py --batch 16 --rounds 4
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from unittest import mock

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import LLM  # noqa: E402
from engine.bench import (  # noqa: E402
    alternating_decode_ms,
    alternating_prefill_ms,
    greedy_agreement,
    machine,
    median_call_us,
    step_summary,
)
from engine.engine_config import EngineConfig  # noqa: E402
from kernels import cpu_linear, onednn  # noqa: E402
from monitor.loadgen import make_prompt  # noqa: E402

ROWS = (1, 4, 16, 64, 256, 1024)


def engines() -> dict[str, LLM]:
    """The two engines; oneDNN's packed weight is what prepare_linear falls back to without the
    kernel."""
    out = {"tile": LLM(EngineConfig("smollm2-135m-instruct", dtype="bfloat16"))}
    with mock.patch.object(cpu_linear, "prepare", return_value=None):  # no kernel: the fallback
        out["onednn"] = LLM(EngineConfig("smollm2-135m-instruct", dtype="bfloat16"))
    kinds = {side: type(llm.model.layers[0].qkv).__name__ for side, llm in out.items()}
    if kinds["tile"] != "Bf16Linear":
        raise SystemExit("The bfloat16 tile kernel does not run here (it needs AVX512-BF16, the "
                         "AMX kernel too where the CPU has AMX, and a C compiler; the engine "
                         f"holds {kinds['tile']}): nothing to compare.")
    return out


def layer_linears(llm: LLM, rounds: int) -> dict:
    """Each layer shape's linear and the LM head at decode and prefill row counts, the tile
    kernel and oneDNN on the same weight."""
    layer = llm.model.layers[0]
    kernels = {name: getattr(layer, name) for name in ("qkv", "o", "gate_up", "down")}
    kernels["lm_head"] = llm.model.lm_head
    out = {}
    for name, kernel in kernels.items():
        packed = onednn.prepare_linear(kernel.dense().contiguous())
        shape = f"{name} {kernel.out_features}x{kernel.in_features}"
        out[shape] = {}
        for rows in ROWS:
            x = torch.randn(rows, kernel.in_features).to(torch.bfloat16)
            repeats = max(3, rounds * 4 * 16 // rows)
            tile = median_call_us(functools.partial(kernel.linear, x), repeats)
            theirs = median_call_us(functools.partial(onednn.linear, x, packed), repeats)
            out[shape][str(rows)] = {"tile": round(tile, 1), "onednn": round(theirs, 1),
                                     "speedup": round(theirs / tile, 3)}
    return out


def replies_agreement(llms: dict[str, LLM], prompts: int = 8, tokens: int = 48) -> dict:
    """Greedy replies of both engines to the same chat prompts, against float32 weights and
    activations': how many are identical, and the mean share of float32's reply in common."""
    reference = LLM(EngineConfig("smollm2-135m-instruct", dtype="float32"))
    rng = np.random.default_rng(7)
    chats = [reference.chat_prompt([{"role": "user",
                                     "content": f"Write about {make_prompt(6, rng)}."}])
             for _ in range(prompts)]
    summary, replies = greedy_agreement(llms, reference, chats, tokens)
    out = {side: {"identical_to_float32": s["identical"], "common_prefix": s["common_prefix"]}
           for side, s in summary.items()}
    out["tile_identical_to_onednn"] = sum(
        a == b for a, b in zip(replies["tile"], replies["onednn"], strict=True))
    return out


def _summary(step_ms: dict) -> dict:
    return step_summary(step_ms, {"tile_over_onednn": ("onednn", "tile")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="decode steps per engine per round")
    p.add_argument("--prefill-prompts", type=int, default=16)
    args = p.parse_args()
    llms = engines()
    rng = np.random.default_rng(args.prefill_prompts)
    batches = [[make_prompt(64, rng) for _ in range(args.prefill_prompts)]
               for _ in range(max(2, args.rounds // 3) + 1)]
    decode = {}
    for batch in args.batch:
        prompt_rng = np.random.default_rng(batch)  # one generator: distinct prompts
        prompts = [make_prompt(64, prompt_rng) for _ in range(batch)]
        decode[str(batch)] = _summary(alternating_decode_ms(llms, prompts, args.rounds,
                                                            args.steps))
    result = {"benchmark": "cpu_bf16", "machine": machine(),
              "baseline": "oneDNN's packed bfloat16 matmul on the same weights (the path "
                          "before the tile kernel); same process, alternating",
              "tile_kernel": "bf16_amx_linear" if cpu_linear.amx_runs() else "bf16_linear",
              "decode": decode,
              "prefill": {str(args.prefill_prompts): _summary(
                  alternating_prefill_ms(llms, batches))},
              "layer_linears_us": layer_linears(llms["tile"], args.rounds),
              "greedy_replies": replies_agreement(llms)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
