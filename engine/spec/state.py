"""A sequence's speculative-decoding state, owned by the spec feature (engine/spec/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.spec.ngram import NgramIndex
from engine.spec.tree import TokenTree


@dataclass
class DraftStats:
    """What one source's drafts achieved for a sequence: break-even prices its next draft from
    these (a proposer with two sources, prompt lookup in front of a draft model, keeps them
    apart: copied text is accepted 90-100% per position and the model's guesses 40-50%, and one
    estimate for both cut lookup's drafts short for several steps after each of the model's
    rejections)."""

    # Running acceptance probability per draft position (tree level); until the first
    # verification, the decoder's prior (what this source's drafts achieved for earlier requests).
    position_rate: float = 0.8
    verifications: int = 0  # drafts verified so far
    width: float = 1.0  # running draft nodes per level: 1 for chains, more for trees


class _OfSource:
    """A field of the sequence's current source's DraftStats, read and written through the
    SpecState (position_rate, verifications, width)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: SpecState | None, owner: type | None = None):
        return self if state is None else getattr(state.stats, self.name)

    def __set__(self, state: SpecState, value) -> None:
        setattr(state.stats, self.name, value)


@dataclass
class SpecState:
    """Drafts waiting for verification and what the proposers remember of the sequence."""

    tokens: list[int] = field(default_factory=list)  # proposed, not yet verified
    probs: list[torch.Tensor] | None = None  # the draft model's distributions, when sampled
    draft_computed: int = 0  # tokens whose keys a draft model has cached
    rate: float = 1.0  # running acceptance estimate, optimistic at first
    # Which of the proposer's sources drafts for the sequence now (Proposer.source; 0 where it
    # has one), and each source's record: position_rate, verifications and width are the
    # current source's.
    source: int = 0
    by_source: dict[int, DraftStats] = field(default_factory=dict)
    ngrams: NgramIndex | None = None  # prompt lookup's index of the sequence's tokens
    idle_steps: int = 0  # steps without drafts since the last (break-even said no)
    cooldown: int = 0  # steps left without drafting after acceptance collapsed
    # Where the target's last hidden state for the sequence lies (a hidden-state draft reads
    # it): a step's hidden rows and the row, kept by reference and gathered only when a draft
    # is made (StateProposer.remember says why).
    hidden_at: tuple[torch.Tensor, int] | None = None
    # The same step's middle-layer streams (StepResult.streams; the row is hidden_at's), where
    # the draft reads them.
    streams: torch.Tensor | None = None
    tree: TokenTree | None = None  # the drafts as a tree (`tokens` are its nodes); None: a chain
    # Per tree node, the proposer's probability that its path is right (the draft's own
    # confidence, product along the path); None where the proposer gives none (prompt lookup).
    node_probs: list[float] | None = None
    # The drafts accepted by the last verification (node indices; a chain's are 0, 1, ...): the
    # rows whose KV and logits are kept.
    path: list[int] = field(default_factory=list)

    position_rate = _OfSource()
    verifications = _OfSource()
    width = _OfSource()

    @property
    def stats(self) -> DraftStats:
        """The current source's record."""
        stats = self.by_source.get(self.source)
        if stats is None:
            stats = self.by_source[self.source] = DraftStats()
        return stats

    @property
    def hidden(self) -> torch.Tensor | None:
        """The target's last hidden state for the sequence (float32, [hidden]), or None."""
        if self.hidden_at is None:
            return None
        rows, row = self.hidden_at
        return rows[row].float()

    @property
    def draft_parents(self) -> list[int] | None:
        """Each draft's parent among the drafts (-1: the last real token) when they form a tree;
        the runner reads it to lay out the tree's positions and attention mask."""
        return None if self.tree is None else list(self.tree.parents)

    def clear_drafts(self) -> None:
        self.tokens, self.probs, self.tree, self.path = [], None, None, []
        self.node_probs = None
