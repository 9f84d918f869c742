"""The step hooks through which optional features (prefix caching, speculative decoding, KV
eviction, teacher forcing) take part in the engine core's step (engine/core.py).

A step is schedule → execute → update. A feature overrides only the hooks it needs; each
keeps its per-sequence state in its own object on the sequence and resets it in on_preempt,
so the scheduler never resets another feature's fields by hand.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.runner import StepResult
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence


@dataclass
class Step:
    """One step as the features see it, filled in as it goes."""

    plan: SchedulerOutput
    result: StepResult | None = None
    # Tokens chosen per sampling sequence (in `sampling` order): one sampled token, or the
    # accepted drafts and one more.
    tokens: list[list[int]] = field(default_factory=list)
    now: float = 0.0

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.plan.scheduled

    @cached_property
    def sampling(self) -> list[ScheduledSeq]:
        """The scheduled sequences that sample this step (the plan is fixed: computed once)."""
        return [s for s in self.plan.scheduled if s.samples]

    @cached_property
    def rows(self) -> list[int]:
        """Each sampling sequence's first logits row (a drafted one has 1 + num_draft rows)."""
        return list(itertools.accumulate((1 + s.num_draft for s in self.sampling), initial=0))


class StepFeature:
    """A feature's hooks, called in this order each step; every default does nothing."""

    def before_schedule(self, running: list[Sequence]) -> None:
        """Before the scheduler plans the step (speculation proposes drafts here)."""

    def wants_mass(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the forward pass must return attention statistics (KV eviction)."""
        return False

    def choose(self, step: Step, logits: torch.Tensor, rows: list[int],
               chosen: list[list[int] | None]) -> None:
        """Fill `chosen[i]` for the sampling sequences this feature decides (drafts verified,
        tokens forced); `rows[i]` is sequence i's first logits row. The rest are sampled."""

    def after_forward(self, step: Step) -> None:
        """Computed counts advanced and tokens chosen, not yet appended."""

    def after_append(self, step: Step) -> int:
        """Tokens appended (finished sequences included); the KV entries this dropped."""
        return 0

    def on_preempt(self, seq: Sequence) -> None:
        """The sequence lost its blocks and will be recomputed from the start: reset its state."""
