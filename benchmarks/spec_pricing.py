"""What break-even's pricing costs each step: `draft_lengths` timed on the engine's own measured
step costs, against the step it prices, as JSON.

Break-even (engine/spec/break_even.py) prices every depth of every decoding sequence before each
step. Here the demo model first runs batches of 1, 4 and 16 open-chat requests with prompt
lookup (so the speculative decoder measures this machine's step costs by query tokens, and each
sequence's acceptance); then `draft_lengths` is timed on those costs and rates at batch 1, 4 and
16 with draft caps of 2, 5 and 10, beside the measured step T(batch) it runs before.
Compare revisions with before_after.py (pass this script's absolute path, so the same script
times each revision's engine):

    python benchmarks/before_after.py --before REV --figure pricing.16x10.ms_per_call \\
        -- $PWD/benchmarks/spec_pricing.py
"""

from __future__ import annotations

import json
import sys
import timeit
from pathlib import Path

# Run as a script, this folder comes first on sys.path and this file's neighbours could shadow
# the project's packages.
sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from engine.spec.break_even import draft_lengths  # noqa: E402
from engine.spec.decoder import spec_state  # noqa: E402

PROMPTS = OPEN_CHAT


def measured_decoder() -> tuple[LLM, list[float]]:
    """The demo model after batches of open-chat requests with prompt lookup: its decoder's
    measured step costs, and the acceptance per draft position the last batch's 16 sequences
    reached (highest first)."""
    model = str(fetch_demo_model(progress=lambda message, fraction: None))
    llm = LLM(model, device="cpu", speculative="ngram:k=10")
    ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in (PROMPTS * 4)]
    seqs = []
    # Batches of 1, 4 and 16 measure those sizes (a size never stepped drafts nothing); the
    # last batch of 16 drafts on them.
    for batch in (1, 4, 16, 16):
        seqs = [llm.sequence(llm.add_request(i, SamplingParams(temperature=0, max_tokens=48)))
                for i in ids[:batch]]
        while llm.has_unfinished():
            llm.step()
    rates = [spec_state(s).position_rate if spec_state(s).verifications
             else llm.spec.position_prior for s in seqs]
    return llm, sorted(rates, reverse=True)


def main() -> int:
    llm, rates = measured_decoder()
    costs = llm.spec.costs
    pricing = {}
    for batch in (1, 4, 16):
        step_s = costs.step_s(batch)
        for cap in (2, 5, 10):
            args = (rates[:batch], [cap] * batch, costs)
            per_call = min(timeit.repeat(lambda a=args: draft_lengths(*a), number=50,
                                         repeat=5)) / 50
            pricing[f"{batch}x{cap}"] = {
                "ms_per_call": per_call * 1e3,
                "step_ms": step_s * 1e3 if step_s else None,
                "share_of_step": per_call / step_s if step_s else None,
                "lengths": draft_lengths(*args)}
    print(json.dumps({"benchmark": "spec_pricing", "model": llm.model_name,
                      "dtype": llm.dtype, "machine": machine(),
                      "step_ms_by_tokens": {n: t * 1e3 for n, t in
                                            sorted(costs.by_tokens.items())},
                      "pricing": pricing}, indent=2))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
