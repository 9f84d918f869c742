"""What growing a draft tree costs, in one process, alternating: the kernel table's fused draft
level (one call: the draft's step, its scores and their top tokens; kernels/cpu_draft.py)
against the level composed from the table's ops, and the table's one-pass softmax_topk against
the torch reference (softmax over the draft's vocabulary, then topk).

The demo model's shipped hidden-state draft (`demo-draft`), real states from a chat reply: the
top-k op alone on 1 and 4 rows of the draft's scores, one level on 1 and 4 rows, and a whole tree
proposal (4 branches) 1, 2 and 3 levels deep. Prints one JSON object: the machine, each case's
median microseconds each way and the ratios.

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


def median_us(fn, calls: int, rounds: int, sides: dict) -> dict[str, float]:
    """fn's median time per call (us) with each side switched in (`sides`: name -> a function
    that switches it in), alternating."""
    times = {side: [] for side in sides}
    for _ in range(rounds):
        for side, switch in sides.items():
            switch()
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
    hidden, token = _reply_state(llm)
    one_pass, fused = draft.ops, draft.fused_level
    with_reference = SimpleNamespace(**(vars(one_pass) | {"softmax_topk": reference.softmax_topk}))

    def side(ops, level):
        def switch() -> None:
            draft.ops, draft.fused_level = ops, level
        return switch

    fused_side = {"fused": side(one_pass, fused)} if fused is not None else {}
    composed = {"composed": side(one_pass, None)}
    top_k_sides = composed | {"reference": side(with_reference, None)}
    cases = {}
    with torch.inference_mode():
        for rows in (1, 4):
            s = hidden.repeat(rows, 1) + 0.01 * torch.arange(rows)[:, None]
            tokens = token.repeat(rows)
            scores = draft.scores(s)
            cases[f"top_{BRANCHES}_of_{rows}_rows"] = median_us(
                lambda x=scores: draft.ops.softmax_topk(x, BRANCHES), args.calls, args.rounds,
                top_k_sides)
            cases[f"level_of_{rows}_rows"] = median_us(
                lambda x=s, t=tokens: draft.level(x, t, BRANCHES), args.calls,
                args.rounds, fused_side | composed)
        for depth in (1, 2, 3):
            cases[f"tree_{depth}_levels"] = median_us(
                lambda d=depth: draft._tree_paths(hidden, token, [d], [BRANCHES]),
                max(10, args.calls // 5), args.rounds, fused_side | top_k_sides)
    side(one_pass, fused)()
    print(json.dumps({
        "benchmark": "draft_tree", "machine": machine(),
        "baseline": "the level composed from the table's ops (draft_step, scores, top_tokens), "
                    "and the reference top-k op (torch softmax over the draft's vocabulary, "
                    "then topk); same process, alternating",
        "fused_level": fused is not None,
        "draft_vocabulary": int(draft.vocab_ids.numel()), "branches": BRANCHES,
        "cases": {name: _figures(t) for name, t in cases.items()}}, indent=1))


def _figures(t: dict[str, float]) -> dict:
    """A case's medians (us) and its ratios: composed over fused (the fused level's speed-up)
    and reference over composed (the one-pass top-k's)."""
    out = {f"{side}_us": round(us, 1) for side, us in t.items()}
    if "fused" in t:
        out["fused_speedup"] = round(t["composed"] / t["fused"], 2)
    if "reference" in t:
        out["one_pass_speedup"] = round(t["reference"] / t["composed"], 2)
    return out


def _reply_state(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """A real draft state ([1, hidden]) and its token ([1]): the target's hidden state the draft
    keeps for a chat reply a few steps in, and the token it chose there."""
    prompt = llm.chat_prompt([{"role": "user", "content": "Tell me about rivers."}])
    rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for _ in range(4):
        llm.step()
    seq = llm.core.seqs[rid]
    hidden, token = spec_state(seq).hidden, seq.all_token_ids[-1]
    while llm.has_unfinished():
        llm.step()
    return hidden.unsqueeze(0), torch.tensor([token])


if __name__ == "__main__":
    main()
