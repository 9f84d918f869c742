"""What preparing a step's attention metadata costs the engine: `ModelRunner._metadata` timed
inside real decode steps of the demo model, against the step, as JSON.

Before each step the runner builds the step's slot mapping, each decode row's key slots and
lengths, and its prefill chunks' slots and masks (engine/runner.py). That is host work on the
engine thread between two kernel calls, so each microsecond of it is a microsecond of every
decode step at batch 1. Here the demo model (int4 weights, the engine's fastest batch-1 path)
answers open-chat prompts one at a time and then 16 at once; every call of `_metadata` is timed
where it runs (after the previous step, with whatever the step left in the caches), and its mean
per decode step is reported beside the mean step. Compare revisions with before_after.py (pass
this script's absolute path, so the same script times each revision's engine):

    python benchmarks/before_after.py --before REV --figure batch_1.metadata_us \\
        -- $PWD/benchmarks/step_metadata.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from engine import LLM, SamplingParams, runner  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

PROMPTS = OPEN_CHAT


class MetadataTimer:
    """Wraps ModelRunner._metadata; counts its calls and seconds."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        self._inner = runner.ModelRunner._metadata
        timer = self

        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return timer._inner(self, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        runner.ModelRunner._metadata = timed

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


def measure(llm: LLM, timer: MetadataTimer, batch: int, max_tokens: int) -> dict:
    """Mean _metadata time and mean step over `batch` requests at once (PROMPTS repeated)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [llm.chat_prompt([{"role": "user", "content": p}])
               for p in (PROMPTS * batch)[:batch]]
    timer.reset()
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return {"steps": timer.calls, "metadata_us": timer.seconds / timer.calls * 1e6,
            "step_ms": wall / timer.calls * 1e3,
            "metadata_share": timer.seconds / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="int4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="runs per batch size (means pooled)")
    args = p.parse_args(argv)
    timer = MetadataTimer()
    llm = LLM(str(fetch_demo_model(progress=lambda m, f: None)), device="cpu",
              weights=args.weights)
    measure(llm, timer, 1, 8)  # warm-up
    result = {"benchmark": "step_metadata", "machine": machine(), "weights": args.weights,
              "max_tokens": args.max_tokens}
    for batch in (1, 16):
        runs = [measure(llm, timer, batch, args.max_tokens) for _ in range(args.rounds)]
        steps = sum(r["steps"] for r in runs)
        result[f"batch_{batch}"] = {
            "steps": steps,
            "metadata_us": sum(r["metadata_us"] * r["steps"] for r in runs) / steps,
            "step_ms": sum(r["step_ms"] * r["steps"] for r in runs) / steps,
            "metadata_share": sum(r["metadata_share"] for r in runs) / len(runs)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
