"""What a KV-eviction policy costs in quality: teacher-forced log-likelihood of a long text.

The text's first `prompt_len` tokens are the prompt (prefilled in chunks, compressed by the
policy as it goes); every later token is decoded one at a time with the true token forced in,
so each policy sees exactly the same tokens and only its cache differs. For every configuration
we get the perplexity of the continuation, the agreement of its top-1 prediction with the
full cache's at each position, and the KV memory it held. All configurations run as one batch
through the engine's continuous batching, the full-cache reference among them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from engine.sequence import SamplingParams


@dataclass
class PolicyScore:
    """One (policy, budget) configuration's quality and memory over the continuation."""

    policy: str
    budget: int | float | None
    budget_tokens: int | None
    tokens_scored: int
    perplexity: float
    top1_agreement: float | None  # with the full cache's top-1; None for the full cache itself
    peak_kv_tokens: int  # the most tokens its cache held at once
    final_kv_tokens: int
    peak_kv_blocks: int
    tokens_evicted: int
    compactions: int

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate_policies(llm, token_ids: list[int], prompt_len: int,
                      configs: list[tuple[str, int | float | None]],
                      progress=None) -> list[PolicyScore]:
    """Score each (policy, budget) on `token_ids`; the full cache ("none") is added first.

    `progress(done, total)` is called after each engine step.
    """
    if not 0 < prompt_len < len(token_ids):
        raise ValueError(f"prompt_len must be between 1 and {len(token_ids) - 1}, got {prompt_len}")
    prompt, forced = token_ids[:prompt_len], token_ids[prompt_len:]
    runs = [("none", None)] + [c for c in configs if c[0] != "none"]
    seqs = []
    for policy, budget in runs:
        params = SamplingParams(temperature=0.0, max_tokens=len(forced), ignore_eos=True,
                                kv_policy=policy, kv_budget=budget)
        seqs.append(llm.sequence(llm.add_request(prompt, params, forced_tokens=forced)))
    peaks = [[0, 0] for _ in seqs]
    while any(not s.is_finished for s in seqs):
        llm.step()
        for peak, seq in zip(peaks, seqs, strict=True):
            if not seq.is_finished:
                peak[0] = max(peak[0], seq.kv_len)
                peak[1] = max(peak[1], len(seq.block_table))
        if progress is not None:
            progress(len(seqs[0].forced.logprobs), len(forced))
    reference = seqs[0].forced.top1
    return [_score(policy, budget, seq, peak, reference if i else None)
            for i, ((policy, budget), seq, peak) in enumerate(zip(runs, seqs, peaks, strict=True))]


def _score(policy: str, budget, seq, peak: list[int], reference: list[int] | None) -> PolicyScore:
    logprobs = seq.forced.logprobs
    agreement = None
    if reference is not None:
        agreement = sum(a == b for a, b in zip(seq.forced.top1, reference, strict=True)) / len(
            reference)
    state = seq.kv
    return PolicyScore(
        policy=policy,
        budget=budget,
        budget_tokens=None if state is None else state.budget,
        tokens_scored=len(logprobs),
        perplexity=math.exp(-sum(logprobs) / len(logprobs)),
        top1_agreement=agreement,
        peak_kv_tokens=peak[0],
        final_kv_tokens=seq.kv_len,
        peak_kv_blocks=peak[1],
        tokens_evicted=0 if state is None else state.evicted,
        compactions=0 if state is None else state.compactions,
    )
