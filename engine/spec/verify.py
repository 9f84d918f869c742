"""The lossless verification rule of speculative sampling (Leviathan et al., Chen et al.).

Draft token d_i is accepted with probability min(1, p(d_i) / q(d_i)), p the target's
distribution (after temperature, top-k and top-p) and q the proposer's; on the first rejection
a token is drawn from the normalised positive part of p - q and the round ends; when every draft
is accepted a bonus token is drawn from the target's distribution after the last draft. A
deterministic proposer (prompt lookup) has q = one-hot(d_i), which makes the rule "accept with
probability p(d_i), else draw from p with d_i removed" (vLLM's ngram path). The output then has
exactly the target's distribution.
"""

from __future__ import annotations

import torch

from engine.sampler import draw, filtered_probs, generator_for
from engine.sequence import Sequence


def verify(seq: Sequence, logits: torch.Tensor, draft: list[int],
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """Tokens to append: the accepted drafts plus one token from the target ([len(draft)+1])."""
    if seq.params.greedy:
        return verify_greedy(logits, draft)
    probs = filtered_probs(logits, [seq.params] * logits.shape[0])
    return verify_sampled(probs, draft, draft_probs, generator_for(seq))


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Accept while each draft equals the target's argmax; then the target's own argmax."""
    best = logits.argmax(dim=-1).tolist()
    out = []
    for i, token in enumerate(draft):
        if token != best[i]:
            break
        out.append(token)
    out.append(best[len(out)])
    return out


def verify_sampled(probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   gen: torch.Generator) -> list[int]:
    """The rejection rule on target probabilities `probs` ([len(draft)+1, V])."""
    out = []
    for i, token in enumerate(draft):
        p = float(probs[i, token])
        q = 1.0 if draft_probs is None else float(draft_probs[i, token])
        u = float(torch.rand(1, generator=gen))
        if q > 0 and u * q <= p:  # u <= p / q without dividing by a tiny q
            out.append(token)
            continue
        out.append(draw(residual(probs[i], token, None if draft_probs is None else
                                 draft_probs[i]), gen))
        return out
    out.append(draw(probs[len(draft)], gen))
    return out


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q), with q one-hot at `token` for a deterministic proposer (unnormalised)."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_(min=0.0)
    # p == q exactly leaves no mass; then any target sample is correct.
    return r if float(r.sum()) > 0 else p
