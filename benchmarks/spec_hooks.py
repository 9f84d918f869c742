"""What the speculative decoder's own work costs each step, beside the step, as JSON.

The demo model decodes open-chat replies with its trained draft's trees
(`demo-draft:lookup=0,branches=4`): one request at a time (batch 1, where drafts are made
nearly every step) and 16 at once (where break-even leaves nearly every sequence without
drafts, so what speculation costs there is its bookkeeping). The decoder's three step hooks
(`before_schedule`: pricing and proposing; `choose`: verification; `after_forward`: the accepted
path kept, the draft's state remembered) are timed inside the real steps, and reported per step
and per generated token beside the whole step's time.

A step's small torch ops and Python run right after its weights (212 MB in bfloat16) have
streamed through the caches, and there they took 5-10x their time in a loop; so this times them
in the engine, not alone. Compare revisions with before_after.py (pass this script's absolute
path, so the same script times each revision's engine):

    python benchmarks/before_after.py --before REV --figure batch.16.hooks_ms_per_step \\
        -- $PWD/benchmarks/spec_hooks.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run as a script, this folder comes first on sys.path and this file's neighbours could shadow
# the project's packages.
sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

SPEC = "demo-draft:lookup=0,branches=4"
HOOKS = ("before_schedule", "choose", "after_forward")
PROMPTS = OPEN_CHAT


class HookTimer:
    """Seconds spent in each of the speculative decoder's step hooks, while `on`."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = dict.fromkeys(HOOKS, 0.0)
        self.on = False
        for name in HOOKS:
            setattr(llm.spec, name, self._timed(name, getattr(llm.spec, name)))

    def _timed(self, name: str, hook):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[name] += time.perf_counter() - start
        return timed


def measure(llm: LLM, timer: HookTimer, batch: int, max_tokens: int, rounds: int) -> dict:
    """`rounds` runs of `batch` open-chat requests at once: steps, tokens, the step's time and
    the hooks' per step and per token (totals over the rounds)."""
    prompts = PROMPTS if batch == 1 else (PROMPTS * batch)[:batch]
    ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    steps = tokens = 0
    step_s = 0.0
    timer.seconds = dict.fromkeys(HOOKS, 0.0)
    for _ in range(rounds):
        for start in range(0, len(ids), batch):
            for prompt in ids[start : start + batch]:
                llm.add_request(prompt, params)
            timer.on = True
            while llm.has_unfinished():
                begun = time.perf_counter()
                _, stats = llm.step()
                step_s += time.perf_counter() - begun
                steps += 1
                tokens += stats.num_generated_tokens
            timer.on = False
    hooks_s = sum(timer.seconds.values())
    return {
        "steps": steps, "tokens": tokens,
        "step_ms": round(step_s / steps * 1e3, 3),
        "hooks_ms_per_step": round(hooks_s / steps * 1e3, 4),
        "hooks_ms_per_token": round(hooks_s / tokens * 1e3, 4),
        "by_hook_ms_per_step": {k: round(v / steps * 1e3, 4) for k, v in timer.seconds.items()},
        "hooks_share_of_step": round(hooks_s / step_s, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model = str(fetch_demo_model(progress=lambda message, fraction: None))
    llm = LLM(model, device="cpu", speculative=SPEC)
    timer = HookTimer(llm)
    measure(llm, timer, 1, 16, 1)  # warm-up: the step costs break-even prices from
    measure(llm, timer, 16, 16, 1)
    result = {"benchmark": "spec_hooks", "spec": SPEC, "dtype": llm.dtype,
              "machine": machine(), "batch": {}}
    for batch in (1, 16):
        result["batch"][str(batch)] = measure(llm, timer, batch, args.max_tokens, args.rounds)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
