"""What growing a draft tree costs, with the kernel table's one-pass softmax_topk against the
torch reference (softmax over the draft's vocabulary, then topk), in one process, alternating.

The demo model's shipped hidden-state draft (`demo-draft`), real states from a chat reply: the
op alone on 1 and 4 rows of the draft's scores, and a whole tree proposal (4 branches) 1, 2
and 3 levels deep. Prints one JSON object: the machine, each case's median microseconds both
ways and the ratio.

    python benchmarks/draft_tree.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from engine.spec.decoder import spec_state  # noqa: E402
from engine.spec.hidden_draft import HiddenDraft  # noqa: E402
from kernels import reference  # noqa: E402

BRANCHES = 4


def median_us(fn, calls: int, rounds: int, switch) -> dict[str, float]:
    """fn's median time per call (us) with each side's op table switched in, alternating."""
    times = {"one_pass": [], "reference": []}
    for _ in range(rounds):
        for side in times:
            switch(side)
            fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[side].append((time.perf_counter() - start) / calls * 1e6)
    return {side: statistics.median(v) for side, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    llm = LLM(str(fetch_demo_model(progress=lambda m, f: None)), device="cpu",
              speculative="demo-draft:lookup=0,branches=4")
    draft = llm.spec.proposer
    if not isinstance(draft, HiddenDraft):
        raise SystemExit("demo-draft did not load the hidden-state draft: nothing to time.")
    hidden = _reply_state(llm)
    tables = {"one_pass": draft.ops,
              "reference": SimpleNamespace(**(vars(draft.ops)
                                              | {"softmax_topk": reference.softmax_topk}))}

    def switch(side: str) -> None:
        draft.ops = tables[side]

    cases = {}
    with torch.inference_mode():
        for rows in (1, 4):
            scores = draft.scores(hidden.repeat(rows, 1) + 0.01 * torch.arange(rows)[:, None])
            cases[f"top_{BRANCHES}_of_{rows}_rows"] = median_us(
                lambda s=scores: draft.ops.softmax_topk(s, BRANCHES), args.calls, args.rounds,
                switch)
        for depth in (1, 2, 3):
            cases[f"tree_{depth}_levels"] = median_us(
                lambda d=depth: draft._tree_paths(hidden, [d], [BRANCHES]),
                max(10, args.calls // 5), args.rounds, switch)
    draft.ops = tables["one_pass"]
    print(json.dumps({
        "benchmark": "draft_tree", "machine": machine(),
        "baseline": "the reference op (torch softmax over the draft's vocabulary, then topk), "
                    "same process, alternating",
        "draft_vocabulary": int(draft.vocab_ids.numel()), "branches": BRANCHES,
        "cases": {name: {"one_pass_us": round(t["one_pass"], 1),
                         "reference_us": round(t["reference"], 1),
                         "speedup": round(t["reference"] / t["one_pass"], 2)}
                  for name, t in cases.items()}}, indent=1))


def _reply_state(llm: LLM) -> torch.Tensor:
    """A real draft state ([1, hidden]): the target's hidden state the draft keeps for a chat
    reply a few steps in."""
    prompt = llm.chat_prompt([{"role": "user", "content": "Tell me about rivers."}])
    rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for _ in range(4):
        llm.step()
    hidden = spec_state(llm.core.seqs[rid]).hidden
    while llm.has_unfinished():
        llm.step()
    return hidden.unsqueeze(0)


if __name__ == "__main__":
    main()
