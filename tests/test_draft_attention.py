"""The drafts benchmarks/draft_attention.py compares: its MLP is the served draft step, and its
attention looks only backwards."""

from __future__ import annotations

import torch

from benchmarks.draft_attention import Draft
from engine.spec.hidden_draft import draft_step

HIDDEN, WIDTH, EPS = 576, 64, 1e-5


def _trained_looking(draft: Draft) -> Draft:
    """Every weight random (a fresh draft's fc2 is zero, which would hide the MLP's path)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.w.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return draft


def test_the_mlp_shape_is_the_served_draft_step():
    draft = _trained_looking(Draft(HIDDEN, WIDTH, attention=False, eps=EPS))
    s, e = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    served = {"fc1.weight": draft.w["fc1"], "fc1.bias": draft.w["fc1_bias"],
              "fc2.weight": draft.w["fc2"], "fc2.bias": draft.w["fc2_bias"],
              "embed_norm.weight": draft.w["embed_norm"]}
    with torch.no_grad():
        assert torch.allclose(draft(s, e), draft_step(s, e, served, EPS), atol=1e-5)


def test_attention_sees_earlier_positions_and_never_later_ones():
    draft = _trained_looking(Draft(HIDDEN, WIDTH, attention=True, eps=EPS))
    gen = torch.Generator().manual_seed(2)
    s, e = torch.randn(1, 8, HIDDEN, generator=gen), torch.randn(1, 8, HIDDEN, generator=gen)
    later, earlier = s.clone(), s.clone()
    later[:, 5:] += 1.0
    earlier[:, 1] += 1.0
    with torch.no_grad():
        out, out_later, out_earlier = draft(s, e), draft(later, e), draft(earlier, e)
    assert torch.allclose(out[:, :5], out_later[:, :5], atol=1e-6)
    assert not torch.allclose(out[:, 2:], out_earlier[:, 2:])


def test_agreement_counts_real_positions_only():
    """A fresh draft predicts "the state stays" (fc2 is zero): where each target token is the
    head's argmax of the input state it agrees everywhere, elsewhere nowhere, however the
    replies of unequal length are padded together."""
    from benchmarks.draft_attention import agreement

    gen = torch.Generator().manual_seed(3)
    embed = torch.randn(100, HIDDEN, generator=gen)
    head = embed[:50]
    replies = []
    for length in (5, 3, 7, 2, 6):
        s = torch.randn(length, HIDDEN, generator=gen)
        replies.append((s.half(), torch.randint(0, 100, (length,), generator=gen), s.half(),
                        (s.half().float() @ head.T).argmax(-1)))
    draft = Draft(HIDDEN, WIDTH, attention=True, eps=EPS)
    assert agreement(draft, replies, embed, head) == 1.0
    wrong = [(s, x, h, (y + 1) % 50) for s, x, h, y in replies]
    assert agreement(draft, wrong, embed, head) == 0.0
