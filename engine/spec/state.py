"""A sequence's speculative-decoding state, owned by the spec feature (engine/spec/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecState:
    """Drafts waiting for verification and what the proposers remember of the sequence."""

    tokens: list[int] = field(default_factory=list)  # proposed, not yet verified
    probs: list[torch.Tensor] | None = None  # the draft model's distributions, when sampled
    draft_computed: int = 0  # tokens whose keys a draft model has cached
    rate: float = 1.0  # running acceptance estimate, optimistic at first
    position_rate: float = 0.8  # running acceptance probability per draft position
    idle_steps: int = 0  # steps without drafts since the last (break-even said no)
    cooldown: int = 0  # steps left without drafting after acceptance collapsed
    hidden: torch.Tensor | None = None  # the target's last hidden state (a hidden-state draft)

    def clear_drafts(self) -> None:
        self.tokens, self.probs = [], None
