"""The lossless verification rule of speculative sampling (Leviathan et al., Chen et al.),
over a whole step's drafts at once.

Draft token d_i is accepted with probability min(1, p(d_i) / q(d_i)), p the target's
distribution (after temperature, top-k and top-p) and q the proposer's; on the first rejection
a token is drawn from the normalised positive part of p - q and the round ends; when every draft
is accepted a bonus token is drawn from the target's distribution after the last draft. A
deterministic proposer (prompt lookup, hidden-state drafts) has q = one-hot(d_i), which makes
the rule "accept with probability p(d_i), else draw from p with d_i removed" (vLLM's ngram
path). The output then has exactly the target's distribution.

Every sequence of the step is verified together: one argmax over all greedy rows, one softmax
over all sampled rows, the acceptance test as one tensor comparison, one draw for all final
tokens; the host reads results twice per step, not once per draft token. Each sequence's
uniforms still come from its own generator, so a seed's output does not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import argmax_rows, filtered_probs, generator_for, inverse_cdf
from engine.sequence import Sequence


@dataclass
class Drafted:
    """One sequence's drafts to verify."""

    seq: Sequence
    logits: torch.Tensor  # [len(draft) + 1, V]: the target at the last real token and each draft
    draft: list[int]
    draft_probs: torch.Tensor | None = None  # [len(draft), V] the proposer's; None: deterministic


def joined(rows: list[torch.Tensor]) -> torch.Tensor:
    """Logits rows of several sequences as one tensor; one sequence's as they are (at batch 1 a
    verification's copy of its own 6-13 rows took about 37 us, after the step's weights had
    passed through the caches)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def verify_all(items: list[Drafted]) -> list[list[int]]:
    """Tokens to append per item: its accepted drafts plus one token from the target."""
    out: list[list[int]] = [[] for _ in items]
    greedy = [i for i, d in enumerate(items) if d.seq.params.greedy]
    sampled = [i for i, d in enumerate(items) if not d.seq.params.greedy]
    if greedy:
        best = argmax_rows(joined([items[i].logits for i in greedy]))
        start = 0
        for i in greedy:
            k = len(items[i].draft)
            out[i] = _accept_greedy(best[start : start + k + 1], items[i].draft)
            start += k + 1
    if sampled:
        chosen = [items[i] for i in sampled]
        params = [d.seq.params for d in chosen for _ in range(len(d.draft) + 1)]
        probs = filtered_probs(joined([d.logits for d in chosen]), params)
        tokens = verify_sampled_all(probs, [d.draft for d in chosen],
                                    [d.draft_probs for d in chosen],
                                    [generator_for(d.seq) for d in chosen])
        for i, t in zip(sampled, tokens, strict=True):
            out[i] = t
    return out


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Accept while each draft equals the target's argmax; then the target's own argmax."""
    return _accept_greedy(argmax_rows(logits), draft)


def _accept_greedy(best: list[int], draft: list[int]) -> list[int]:
    out = []
    for i, token in enumerate(draft):
        if token != best[i]:
            break
        out.append(token)
    out.append(best[len(out)])
    return out


def verify_sampled(probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   gen: torch.Generator) -> list[int]:
    """The rejection rule for one sequence's target probabilities `probs` ([len(draft)+1, V])."""
    return verify_sampled_all(probs, [draft], [draft_probs], [gen])[0]


def verify_sampled_all(probs: torch.Tensor, drafts: list[list[int]],
                       draft_probs: list[torch.Tensor | None],
                       gens: list[torch.Generator]) -> list[list[int]]:
    """The rejection rule for many sequences: `probs` holds each one's len(draft) + 1 rows,
    one sequence after another."""
    lengths = [len(d) for d in drafts]
    starts = [0]
    for k in lengths:
        starts.append(starts[-1] + k + 1)
    width = max(lengths, default=0)
    rows = torch.zeros(len(drafts), width, dtype=torch.long)
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)
    q = torch.ones(len(drafts), width)
    u = torch.ones(len(drafts), width)  # padding: never accepted (valid is False there)
    valid = torch.zeros(len(drafts), width, dtype=torch.bool)
    for i, (draft, k) in enumerate(zip(drafts, lengths, strict=True)):
        if not k:
            continue
        rows[i, :k] = torch.arange(starts[i], starts[i] + k)
        tokens[i, :k] = torch.tensor(draft)
        valid[i, :k] = True
        u[i, :k] = torch.rand(k, generator=gens[i])
        if draft_probs[i] is not None:
            q[i, :k] = draft_probs[i][torch.arange(k), tokens[i, :k]]
    p = probs[rows, tokens]
    # u <= p / q without dividing by a tiny q; a q of 0 (never proposed) is never accepted.
    accept = valid & (q > 0) & (u * q <= p)
    accepted = accept.int().cumprod(dim=1).sum(dim=1).tolist()
    final = torch.stack([_final_distribution(probs, starts[i], tokens[i], draft_probs[i], n, k)
                         for i, (n, k) in enumerate(zip(accepted, lengths, strict=True))])
    last = inverse_cdf(final, torch.cat([torch.rand(1, generator=g) for g in gens]))
    return [draft[:n] + [t] for draft, n, t in zip(drafts, accepted, last, strict=True)]


def _final_distribution(probs: torch.Tensor, start: int, tokens: torch.Tensor,
                        draft_probs: torch.Tensor | None, accepted: int, k: int) -> torch.Tensor:
    """What the round's last token is drawn from: the residual at the first rejection, or the
    target after the last draft when all were accepted (unnormalised)."""
    p = probs[start + accepted]
    if accepted == k:
        return p
    return residual(p, int(tokens[accepted]), None if draft_probs is None
                    else draft_probs[accepted])


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q), with q one-hot at `token` for a deterministic proposer (unnormalised).
    Where p == q exactly no mass is left; then any target sample is correct."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_(min=0.0)
    return torch.where(r.sum() > 0, r, p)
