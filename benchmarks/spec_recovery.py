"""Speculation after the machine was busy for a moment: does drafting come back? Prints one JSON.

The engine learns a step's cost only from steps of that size (engine/spec/break_even.py), so
verifications measured while another process held the cores looked dear, drafting stopped, and
with it the only steps that could measure them again. Two engines with the shipped trees
(`demo-draft:lookup=0,branches=4`), one with the costs' staleness rule (the cost probe; now)
and one without it (its window set beyond any run: before), each decode the open-chat prompts
one at a time: once on a quiet machine, once while a second process multiplies matrices on
every core for --busy-s seconds, then --after times on the quiet machine again. Whether the
moment leaves stale costs that stop drafting depends on which step sizes it happens to slow,
so each of --trials trials starts both engines afresh (alternating which goes first). Per
trial and phase: tokens/s and drafts made; per engine, the trials that ended without drafting
(fewer than a tenth of the quiet phase's drafts in the last phase) and the median ratio of the
last phase's tokens/s to the quiet one's.

Run: python benchmarks/spec_recovery.py [--trials 4] [--busy-s 6] [--after 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.speculative import run_workload  # noqa: E402
from engine import LLM  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

SPEC = "demo-draft:lookup=0,branches=4"
HOG = ("import time, torch\n"
       "x, end = torch.randn(2000, 2000), time.time() + {seconds}\n"
       "while time.time() < end:\n"
       "    x @ x\n")


def phase(llm: LLM, max_tokens: int) -> dict:
    """The open-chat prompts one at a time (speculative.py's run_workload, its short warm-up
    request first): tokens/s, and the drafts the engine made."""
    drafts = llm.spec.summary()["drafts"]
    speed = run_workload(llm, OPEN_CHAT, max_tokens)["tokens_per_s"]
    return {"tokens_per_s": round(speed, 1), "drafts": llm.spec.summary()["drafts"] - drafts}


def run(llm: LLM, busy_s: float, after: int, max_tokens: int) -> dict:
    quiet = phase(llm, max_tokens)
    hog = subprocess.Popen([sys.executable, "-c", HOG.format(seconds=busy_s)])
    try:
        busy = phase(llm, max_tokens)
    finally:
        hog.wait()
    later = [phase(llm, max_tokens) for _ in range(after)]
    return {"quiet": quiet, "busy": busy, "after": later,
            "drafting_stopped": later[-1]["drafts"] < quiet["drafts"] / 10,
            "last_over_quiet": round(later[-1]["tokens_per_s"] / quiet["tokens_per_s"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--busy-s", type=float, default=6.0)
    parser.add_argument("--after", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    model = str(fetch_demo_model(progress=lambda m, f: None))
    windows = {"before": 1 << 62, "now": None}  # before: never stale, nothing re-measured
    trials: dict[str, list[dict]] = {name: [] for name in windows}
    for t in range(args.trials):
        for name in (list(windows) if t % 2 == 0 else list(windows)[::-1]):
            llm = LLM(model, device="cpu", speculative=SPEC)
            if windows[name] is not None:
                llm.spec.costs.stale_after = windows[name]
            print(f"trial {t + 1}, {name}: quiet, busy {args.busy_s} s, quiet", file=sys.stderr)
            trials[name].append(run(llm, args.busy_s, args.after, args.max_tokens))
            llm.close()
    summary = {name: {"trials_drafting_stopped": sum(r["drafting_stopped"] for r in runs),
                      "median_last_over_quiet": statistics.median(r["last_over_quiet"]
                                                                  for r in runs)}
               for name, runs in trials.items()}
    print(json.dumps({"benchmark": "spec_recovery", "spec": SPEC, "busy_s": args.busy_s,
                      "trials": args.trials, "summary": summary, "runs": trials,
                      "machine": machine()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
