"""What choosing tokens costs the engine's decode, greedy and sampled, now against the way before.

Two token-choice paths ran on torch CPU ops that are slow at the demo model's 49,152-token
vocabulary: the greedy argmax (torch's, about 86 us a row on the 2-core CPU; now NumPy's,
`engine.sampler.argmax_rows`) and the top-p nucleus (a sort of the whole row, about 3 ms; now
`torch.topk` widened until the nucleus ends, `engine.sampler._apply_top_k_top_p`, the rows
whose nucleus ends among the first ranks cut together). This decodes in one process with each
choice path in turn (rounds alternate their order): greedy, and sampled at the Engine pane's
chat defaults (temperature 0.7, top-p 0.95), one request at a time, 16 and (sampled) 64 at once,
64-token replies with ignore_eos; and times the choice alone (`sample` on 16 rows of the model's
real logits for the chat prompts). The paths: now, row_by_row (the nucleus cut a row at a time,
as from 2026-12-06) and before (both as they were first); the earlier two are this file's
copies of the code. Prints one JSON object: the machine, per workload the median tok/s of each
path and the ratios now / before and now / row_by_row, and the choice's milliseconds per
16-row step.

    .venv/bin/python benchmarks/sampling.py [--rounds 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import LLM, SamplingParams, sampler  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

PROMPTS = OPEN_CHAT
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.95}  # app/panes/engine/state.py


def torch_argmax_rows(logits: torch.Tensor) -> list[int]:
    """The greedy choice before: torch's argmax."""
    return logits.argmax(dim=-1).tolist()


def sorted_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]):
    """The nucleus before: a sort of every whole row."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k]).unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    remove |= (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_p).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def row_by_row_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]):
    """The nucleus in between (2026-12-06 to -07): the first ranks from torch.topk as now, but
    every row's cut made and written on its own."""
    vocab = logits.shape[-1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    rows = [i for i, (k, p) in enumerate(zip(ks, top_p, strict=True)) if k < vocab or p < 1.0]
    if not rows:
        return logits
    doubled = logits[rows].double()
    first = doubled.topk(min(vocab, sampler.NUCLEUS_FIRST_RANKS), dim=-1)
    log_totals = doubled.logsumexp(dim=-1)
    out = logits.clone()
    for j, i in enumerate(rows):
        kept = _row_kept_tokens(doubled[j], ks[i], top_p[i],
                                (first.values[j], first.indices[j]), log_totals[j])
        row = torch.full_like(logits[i], float("-inf"))
        row[kept] = logits[i, kept]
        out[i] = row
    return out


def _row_kept_tokens(row: torch.Tensor, k: int, p: float, first: tuple, log_total: torch.Tensor):
    """One row's kept ids, its ranks widened on their own (row_by_row's)."""
    values, ids = first[0][:k], first[1][:k]
    ranked_all_k = k <= first[1].numel()
    if p >= 1.0:
        return ids if ranked_all_k else row.topk(k).indices
    if k < row.numel():
        log_total = (values if ranked_all_k else row.topk(k).values).logsumexp(-1)
    while True:
        probs = (values - log_total).exp()
        past = ((probs.cumsum(-1) - probs) >= p).nonzero()
        if past.numel():
            return ids[: max(1, int(past[0]))]
        width = ids.numel()
        if width == k:
            return ids
        n = k if 4 * width > sampler.TOPK_UP_TO else min(4 * width, k)
        if n <= sampler.TOPK_UP_TO:
            values, ids = row.topk(n)
        else:
            ids = torch.from_numpy(np.argsort(-row.numpy())[:n])
            values = row[ids]


# The sampler's choice functions by path: as they are, row by row (the nucleus cut one row at a
# time, greedy as now) and as they were before both (torch's argmax, a sort of every row).
PATHS = {"now": None, "row_by_row": (sampler.argmax_rows, row_by_row_top_k_top_p),
         "before": (torch_argmax_rows, sorted_top_k_top_p)}


@contextmanager
def choice_path(path: str):
    """The sampler's choice functions as PATHS names them."""
    saved = sampler.argmax_rows, sampler._apply_top_k_top_p
    if PATHS[path] is not None:
        sampler.argmax_rows, sampler._apply_top_k_top_p = PATHS[path]
    try:
        yield
    finally:
        sampler.argmax_rows, sampler._apply_top_k_top_p = saved


def choice_ms(logits: torch.Tensor, params: SamplingParams, path: str,
              repeats: int = 20) -> float:
    """Milliseconds `sample` takes for one step of as many sequences as `logits` has rows
    (median of `repeats`)."""
    from engine.sequence import Sequence

    seqs = [Sequence(f"r{i}", [1], params, 0.0) for i in range(len(logits))]
    times = []
    with choice_path(path):
        for _ in range(repeats):
            start = time.perf_counter()
            sampler.sample(logits, seqs)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tokens_per_s(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(str(fetch_demo_model(progress=lambda m, f: None)), device="cpu")
    chat = [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    workloads = {}
    for kind, extra in (("greedy", {"temperature": 0.0}), ("sampled", CHAT_DEFAULTS)):
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0, **extra)
        workloads[f"{kind}_batch_1"] = (chat[:1], params)
        workloads[f"{kind}_batch_16"] = ((chat * 4)[:16], params)
    # A server's busy hour: 64 requests at once, where choosing costs the most.
    workloads["sampled_batch_64"] = ((chat * 16)[:64], workloads["sampled_batch_1"][1])
    tokens_per_s(llm, chat[:2], SamplingParams(max_tokens=8))  # warm-up
    runs: dict[str, dict[str, list[float]]] = {w: {p: [] for p in PATHS} for w in workloads}
    for r in range(args.rounds):
        for name, (prompts, params) in workloads.items():
            for path in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
                with choice_path(path):
                    speed = tokens_per_s(llm, prompts, params)
                runs[name][path].append(speed)
                print(f"round {r + 1} {name} {path}: {speed:.1f} tok/s", file=sys.stderr)
    # One 16-sequence step's logits: the model's at the last 16 positions of the chat prompts.
    step_logits = torch.cat([llm.prompt_logits(p) for p in chat])[-16:]
    choice = {kind: {f"{path}_ms": choice_ms(step_logits, workloads[f"{kind}_batch_16"][1], path)
                     for path in PATHS}
              for kind in ("greedy", "sampled")}
    result = {"benchmark": "token_choice", "model": llm.model_name, "dtype": llm.dtype,
              "machine": machine(), "rounds": args.rounds, "max_tokens": args.max_tokens,
              "choice_per_16_row_step": choice, "workloads": {}}
    for name, r in runs.items():
        medians = {path: statistics.median(r[path]) for path in PATHS}
        result["workloads"][name] = {
            **{f"{path}_tokens_per_s": medians[path] for path in PATHS},
            "ratio": medians["now"] / medians["before"],
            "ratio_to_row_by_row": medians["now"] / medians["row_by_row"],
            **{f"rounds_{path}": r[path] for path in PATHS}}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
