"""The CPU's C kernels (kernels/cpu_kernels.py) against the torch reference ops they replace, in
real engine steps of the demo model, alternating in one process.

For each batch size, one engine holds that many requests decoding (64-word prompts, greedy,
ignore_eos); every round runs a few steps with the reference's decode attention, RMSNorm, rotary
and SwiGLU in the CPU table, then the same number with the C kernels, so the machine's load
falls on both alike. A prefill of 16 fresh prompts is timed the same way. Prints one JSON
object: the machine, each batch's median step time both ways and the ratio, and the share of a
decode step the attention op takes both ways.

    python benchmarks/cpu_kernels.py                    # batch 1 and 16, 12 rounds
    python benchmarks/cpu_kernels.py --batch 16 --rounds 4
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

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from kernels import cpu_kernels, reference  # noqa: E402
from monitor.loadgen import make_prompt  # noqa: E402

SIDES = ("reference", "c")


class Table:
    """The engine's CPU op table, switched between the reference ops and the C kernels, with the
    time spent in paged_attention counted per side."""

    def __init__(self, llm: LLM):
        self.table = llm.model.ops
        if self.table.name != "onednn":
            raise SystemExit(f"The engine runs the '{self.table.name}' kernels here, not the CPU "
                             "table (onednn): nothing to compare.")
        if not cpu_kernels.available():
            raise SystemExit("The C kernels did not build or pass their self-check here: "
                             "nothing to compare (see the log).")
        self.attention_s = 0.0
        self.ops = {"reference": {op: getattr(reference, op) for op in cpu_kernels.OPS},
                    "c": dict(cpu_kernels.OPS)}

    def use(self, side: str) -> None:
        for op, fn in self.ops[side].items():
            setattr(self.table, op, fn)
        attention = self.ops[side]["paged_attention"]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = attention(*args, **kwargs)
            self.attention_s += time.perf_counter() - start
            return out

        self.table.paged_attention = timed


def decode_steps(batch: int, rounds: int, steps: int, dtype: str) -> dict:
    llm = LLM(EngineConfig("smollm2-135m-instruct", dtype=dtype))
    table = Table(llm)
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=2 * rounds * (steps + 1) + 8,
                            ignore_eos=True)
    for _ in range(batch):
        llm.add_request(make_prompt(64, rng), params)
    for _ in range(3):  # the prefill, then warm decode steps
        llm.step()
    step_ms = {side: [] for side in SIDES}
    attention_ms = {side: [] for side in SIDES}
    for _ in range(rounds):
        for side in SIDES:
            table.use(side)
            llm.step()
            table.attention_s = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                llm.step()
            step_ms[side].append((time.perf_counter() - start) / steps * 1e3)
            attention_ms[side].append(table.attention_s / steps * 1e3)
    return _summary(step_ms, attention_ms) | {"dtype": llm.dtype}


def prefill_steps(prompts: int, rounds: int, dtype: str) -> dict:
    llm = LLM(EngineConfig("smollm2-135m-instruct", dtype=dtype))
    table = Table(llm)
    rng = np.random.default_rng(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    step_ms = {side: [] for side in SIDES}
    for round_ in range(rounds + 1):
        for side in SIDES:
            table.use(side)
            for _ in range(prompts):
                llm.add_request(make_prompt(64, rng), params)
            start = time.perf_counter()
            while llm.has_unfinished():
                llm.step()
            if round_:  # the first round warms both sides up
                step_ms[side].append((time.perf_counter() - start) * 1e3)
    return _summary(step_ms, None)


def _summary(step_ms: dict, attention_ms: dict | None) -> dict:
    median = {side: statistics.median(v) for side, v in step_ms.items()}
    out = {"step_ms": {side: round(m, 2) for side, m in median.items()},
           "speedup": round(median["reference"] / median["c"], 3),
           "rounds": {side: [round(x, 2) for x in v] for side, v in step_ms.items()}}
    if attention_ms is not None:
        out["attention_ms"] = {side: round(statistics.median(v), 2)
                               for side, v in attention_ms.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="decode steps per side per round")
    p.add_argument("--prefill-prompts", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    result = {"benchmark": "cpu_kernels", "machine": machine(),
              "baseline": "the torch reference ops in the same CPU table (oneDNN linears)",
              "decode": {str(b): decode_steps(b, args.rounds, args.steps, args.dtype)
                         for b in args.batch},
              "prefill": {str(args.prefill_prompts): prefill_steps(
                  args.prefill_prompts, max(2, args.rounds // 3), args.dtype)}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
