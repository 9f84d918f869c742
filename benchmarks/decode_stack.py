"""A decode step's layers in one C call (kernels/cpu_layers.py) against the model's op-by-op loop
(the path before it), in real engine steps of the demo model, alternating in one process.

Two engines load the demo model in bfloat16 (or with int4 / int8 weights), the same weights;
one has its decode stack removed, so every step runs the loop of engine/model.py. For each
batch size both hold that many requests decoding (64-word prompts, greedy, ignore_eos) and
every round runs a few steps of each in turn, so the machine's load falls on both alike. Both
engines' greedy replies (tokens and log-probabilities) to the same chat prompts are compared:
they must be identical. Prints one JSON object: the machine, the median step times and the
ratios.

    python benchmarks/decode_stack.py                    # batch 1, 4 and 16, 10 rounds
    python benchmarks/decode_stack.py --batch 16 --rounds 4 --weights int4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import alternating_decode_ms, machine, step_summary  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from kernels import cpu_linear  # noqa: E402
from monitor.loadgen import make_prompt  # noqa: E402


def engines(weights: str) -> dict[str, LLM]:
    config = EngineConfig("smollm2-135m-instruct", dtype="bfloat16", weights=weights)
    out = {"one_call": LLM(config), "op_by_op": LLM(config)}
    if out["one_call"].model.decode_stack is None:
        raise SystemExit("The one-call decode step does not run here (it needs bfloat16 weights "
                         "or int4 / int8 ones in the C kernels' layouts: AVX512-BF16 and a C "
                         "compiler): nothing to compare.")
    out["op_by_op"].model.decode_stack = None
    return out


def replies_identical(llms: dict[str, LLM], prompts: int = 8, tokens: int = 48) -> dict:
    """Greedy replies (token ids and top-2 log-probabilities) of both engines to the same chat
    prompts, decoded together: how many are identical."""
    rng = np.random.default_rng(7)
    chats = [llms["one_call"].chat_prompt([{"role": "user",
                                            "content": f"Write about {make_prompt(6, rng)}."}])
             for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=2)
    replies = {side: [(o.token_ids, [(t.logprob, t.top) for t in o.logprobs])
                      for o in llm.generate(chats, params)] for side, llm in llms.items()}
    return {"prompts": prompts, "identical": sum(
        a == b for a, b in zip(replies["one_call"], replies["op_by_op"], strict=True))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="decode steps per engine per round")
    p.add_argument("--weights", default="float", help="float (bfloat16 here), int4 or int8")
    p.add_argument("--prompt-words", type=int, default=64,
                   help="words per prompt (a long one makes attention a larger share)")
    args = p.parse_args()
    llms = engines(args.weights)
    decode = {}
    for batch in args.batch:
        rng = np.random.default_rng(batch)
        prompts = [make_prompt(args.prompt_words, rng) for _ in range(batch)]
        decode[str(batch)] = step_summary(
            alternating_decode_ms(llms, prompts, args.rounds, args.steps),
            {"one_call_over_op_by_op": ("op_by_op", "one_call")})
    print(json.dumps({
        "benchmark": "decode_stack", "machine": machine(),
        "baseline": "the model's op-by-op loop on the same weights (the path before the one "
                    "call); same process, alternating",
        "weights": args.weights, "prompt_words": args.prompt_words,
        "linear_kernel": "bf16_amx_linear" if cpu_linear.amx_runs() else "bf16_linear",
        "decode": decode, "greedy_replies": replies_identical(llms)}, indent=1))


if __name__ == "__main__":
    main()
