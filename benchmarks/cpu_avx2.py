"""The default precision on x86 CPUs with AVX2 but without AVX512-BF16 (Zen 2 / Zen 3 EPYCs,
Intel before Cooper Lake): bfloat16 through the AVX2 build of the C tile kernels (what `auto`
means there since they exist) against float32 through oneDNN's packed matmul (`auto` before),
in real engine steps of the demo model, alternating in one process.

Four engines load the demo model: `bfloat16` (its linears through the AVX2 tile kernels and a
decode step in one C call, kernels/cpu_layers.py), `float32` (oneDNN), `bfloat16_f_linear`
(bfloat16 without the kernels: F.linear, what `--dtype bfloat16` ran here before) and `int4`
(`--weights int4` in bfloat16, the int4 / int8 AVX2 kernels). For each batch size each engine
holds that many requests decoding (64-word prompts, greedy, ignore_eos); every round runs a few
steps of each in turn, so the machine's load falls on all alike. A prefill of 16 fresh prompts is
timed the same way. Quality beside speed: perplexity over the start of Alice ch. I, and greedy
chat replies against float32's. Prints one JSON object: the machine, the median step times and
the ratios over float32 (and over bfloat16 through F.linear).

    python benchmarks/cpu_avx2.py                   # batch 1 and 16, 6 rounds
    python benchmarks/cpu_avx2.py --batch 16 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import math
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
    step_summary,
)
from engine.cpu_features import avx2_tiles  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from kernels import cpu_linear  # noqa: E402
from monitor.loadgen import make_prompt  # noqa: E402

MODEL = "smollm2-135m-instruct"
TEXT = _HERE / "data" / "alice_chapter1.txt"
RATIOS = {"bfloat16_over_float32": ("float32", "bfloat16"),
          "int4_over_float32": ("float32", "int4"),
          "bfloat16_over_f_linear": ("bfloat16_f_linear", "bfloat16")}


def engines() -> dict[str, LLM]:
    out = {"bfloat16": LLM(EngineConfig(MODEL, dtype="bfloat16")),
           "float32": LLM(EngineConfig(MODEL, dtype="float32")),
           "int4": LLM(EngineConfig(MODEL, dtype="bfloat16", weights="int4"))}
    with mock.patch.object(cpu_linear, "prepare", return_value=None):  # no kernel: F.linear
        out["bfloat16_f_linear"] = LLM(EngineConfig(MODEL, dtype="bfloat16"))
    kinds = {side: type(llm.model.layers[0].qkv).__name__ for side, llm in out.items()}
    if kinds["bfloat16"] != "Bf16Linear" or kinds["int4"] != "Int4Linear":
        raise SystemExit("The AVX2 tile kernels do not run here (they need AVX2, FMA and F16C, "
                         f"a C compiler; the engines hold {kinds}): nothing to compare.")
    return out


def perplexity(llms: dict[str, LLM], tokens: int) -> dict:
    """exp(mean negative log-likelihood) over the first `tokens` tokens of Alice ch. I, one
    prefill each."""
    ids = llms["float32"].tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:tokens]
    out = {}
    for side, llm in llms.items():
        logp = torch.log_softmax(llm.prompt_logits(ids)[:-1].double(), dim=-1)
        nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        out[side] = round(math.exp(nll), 3)
    return {"tokens": len(ids), "perplexity": out}


def replies_agreement(llms: dict[str, LLM], prompts: int = 8) -> dict:
    """Greedy replies to the same chat prompts against float32's: how many are identical, and
    the mean share of float32's reply in common."""
    rng = np.random.default_rng(7)
    chats = [llms["float32"].chat_prompt([{"role": "user",
                                           "content": f"Write about {make_prompt(6, rng)}."}])
             for _ in range(prompts)]
    return greedy_agreement(llms, "float32", chats)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="decode steps per engine per round")
    p.add_argument("--prefill-prompts", type=int, default=16)
    p.add_argument("--perplexity-tokens", type=int, default=1024)
    args = p.parse_args()
    if not avx2_tiles():
        raise SystemExit("This CPU is not one the AVX2 build serves (it has AVX512-BF16, or "
                         "lacks AVX2, FMA or F16C): benchmarks/cpu_bf16.py measures the "
                         "AVX512-BF16 kernel.")
    llms = engines()
    rng = np.random.default_rng(args.prefill_prompts)
    batches = [[make_prompt(64, rng) for _ in range(args.prefill_prompts)]
               for _ in range(max(2, args.rounds // 3) + 1)]
    decode = {}
    for batch in args.batch:
        prompt_rng = np.random.default_rng(batch)  # one generator: distinct prompts
        prompts = [make_prompt(64, prompt_rng) for _ in range(batch)]
        decode[str(batch)] = step_summary(
            alternating_decode_ms(llms, prompts, args.rounds, args.steps), RATIOS)
    result = {"benchmark": "cpu_avx2", "machine": machine(),
              "baseline": "float32 through oneDNN's packed matmul (auto before the AVX2 tile "
                          "kernels); bfloat16 through F.linear; same process, alternating",
              "decode": decode,
              "prefill": {str(args.prefill_prompts): step_summary(
                  alternating_prefill_ms(llms, batches), RATIOS)},
              "quality": {**perplexity(llms, args.perplexity_tokens),
                          "greedy_replies": replies_agreement(llms)}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
