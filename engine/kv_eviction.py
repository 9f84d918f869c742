"""KV-cache eviction: keep only the cached tokens attention still uses, within a token budget.

Policies (one class each, subclasses of Policy, chosen by name per engine or per request):

- `streaming` (StreamingLLM): the first `sinks` tokens (attention sinks) and a recent window.
- `h2o` (Heavy-Hitter Oracle): per layer and KV head, the tokens with the largest attention
  accumulated over every query so far, plus a recent window.
- `scissorhands`: per layer and KV head, the tokens whose attention was above average most
  persistently over a history window (an exponential average of "was important", standing in
  for the paper's fixed window of counts), plus a recent window.
- `snapkv`: once, at the end of the prompt: per layer and KV head, the prompt tokens the last
  `window` prompt queries attended to most (max-pooled over neighbours, as in the paper); after
  that the compressed prompt is kept and generated tokens slide through a recent window.
- `none`: everything is kept.

How it fits the paged cache: a sequence's block table is shared by all layers, but the slot
contents need not be: after compaction, cache index i of layer l, head h holds whichever token
that head kept in i-th place. Keys are cached after rotary, so a kept key carries its original
position and attention is indifferent to where it sits; new tokens continue at their true
positions (`Sequence.position_offset` = tokens evicted). StreamingLLM instead re-positions, as
its paper does: kept keys are re-rotated to their new cache index (rotary angles add, so
rotating by the position change is exact) and new tokens take positions within the cache, so
generation can run past the model's context length.

Only a sequence's private blocks are touched: blocks it shares through the prefix cache (the
leading `num_cached_blocks`) are never moved, and a sequence under a policy adds no blocks to
the prefix cache. Compaction packs the kept tokens after the shared ones and frees whole blocks
back to the pool. It runs after a step's tokens are accepted (so after speculative
verification), when a sequence holds more than its budget plus one block, bringing it back to
the budget: memory stays bounded and the cost is paid once per block of growth. (A shared
prefix longer than the budget leaves no room for private tokens: they then slide through a
window of up to one block.) A preempted sequence restarts its state and is recomputed from its
first token, outputs included, in chunks no larger than its prompt's (Sequence.max_chunk_tokens),
so its cache peaks no higher than admission allowed for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.features import Step, StepFeature
from engine.kv_options import TRAITS, policy_name
from engine.kv_options import resolve_budget as resolve_budget  # re-exported for its callers
from engine.sequence import Sequence, Status


@dataclass(frozen=True)
class Policy(ABC):
    """An eviction policy, one class each (as kvpress's presses are): what it scores, when it
    compacts and which cache indices it keeps. The constants are the papers' defaults."""

    name: ClassVar[str]
    needs_mass: ClassVar[bool] = False  # scores tokens by the attention they receive

    @property
    def repositions(self) -> bool:
        """Kept keys move to new positions, so the sequence runs past the context."""
        return TRAITS[self.name].repositions

    @property
    def holds_prompt(self) -> bool:
        """Keeps the whole prompt until the prompt ends."""
        return TRAITS[self.name].holds_prompt

    def wants_mass(self, state: KVState) -> bool:
        """Whether this step's attention statistics are needed."""
        return self.needs_mass

    def mass_rows(self, seq: Sequence, num_new: int) -> int | None:
        """How many of a chunk's last queries the statistics sum (None: all of them)."""
        return None

    def score(self, state: KVState, mass: torch.Tensor, seq: Sequence) -> None:  # noqa: B027
        """Fold one step's attention mass ([layers, kv_heads, kv_len]) into state.scores."""

    def target(self, seq: Sequence, state: KVState, movable: int, keep: int,
               block: int) -> tuple[int, bool] | None:
        """(movable tokens to keep, whether this is a one-off snapshot) when the sequence should
        compact now; None to wait. Default: once it is a block over its budget (not kv_len <=
        budget + a block: with a shared prefix longer than the budget that would compact at
        every step instead of once per block)."""
        return None if movable <= keep + block else (keep, False)

    @abstractmethod
    def select(self, state: KVState, start: int, end: int, keep: int, shape: tuple[int, int],
               snapshot: bool) -> torch.Tensor:
        """The cache indices each layer and KV head keeps, ascending ([layers, kv_heads, keep])."""


@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM: the first `sinks` tokens (attention sinks) and a recent window."""

    name: ClassVar[str] = "streaming"
    sinks: int = 4

    def select(self, state, start, end, keep, shape, snapshot) -> torch.Tensor:
        sinks = max(0, min(self.sinks - start, keep))
        return _shared(torch.arange(start, start + sinks), end - (keep - sinks), end, shape)


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy-Hitter Oracle: per layer and KV head, the tokens with the most attention summed
    over every query so far, plus a recent window."""

    name: ClassVar[str] = "h2o"
    needs_mass: ClassVar[bool] = True
    recent_fraction: float = 0.5  # half recent window, half heavy hitters

    def score(self, state, mass, seq) -> None:
        state.scores += mass

    def select(self, state, start, end, keep, shape, snapshot) -> torch.Tensor:
        recent = min(keep, int(keep * self.recent_fraction))
        return _heavy_and_recent(state.scores, start, end, keep, recent, shape)


@dataclass(frozen=True)
class Scissorhands(H2O):
    """Per layer and KV head, the tokens whose attention was above average most persistently (an
    exponential average of "was important", standing in for the paper's window of counts)."""

    name: ClassVar[str] = "scissorhands"
    decay: float = 1.0 - 1.0 / 64  # a history window of about 64 steps

    def score(self, state, mass, seq) -> None:
        important = (mass > mass.mean(dim=-1, keepdim=True)).float()
        state.scores.mul_(self.decay).add_(important)


@dataclass(frozen=True)
class SnapKV(Policy):
    """Once, at the end of the prompt: per layer and KV head, the prompt tokens the last `window`
    prompt queries attended to most (max-pooled over neighbours); afterwards the compressed
    prompt stays and generated tokens slide through a recent window."""

    name: ClassVar[str] = "snapkv"
    needs_mass: ClassVar[bool] = True
    window: int = 32  # the observation window
    pool: int = 7  # the max-pool kernel

    def wants_mass(self, state: KVState) -> bool:
        return not state.snapped

    def mass_rows(self, seq: Sequence, num_new: int) -> int | None:
        """Of a chunk of `num_new` tokens from `seq.num_computed_tokens` on, its last rows that
        fall in the window (the window may span chunks: the prompt may end in a tiny one)."""
        end = seq.num_computed_tokens + num_new
        prompt_len = len(seq.prompt_token_ids)
        if end > prompt_len:  # a recompute chunk past the prompt: its own last queries
            return min(self.window, num_new)
        return min(num_new, max(0, end - (prompt_len - self.window)))

    def score(self, state, mass, seq) -> None:
        # Chunks before the window bring zeros; at the prompt's end the window's summed
        # attention is max-pooled over neighbours.
        state.scores += mass
        if seq.num_computed_tokens >= len(seq.prompt_token_ids):
            n = state.scores.shape[-1]
            state.scores = F.max_pool1d(state.scores, self.pool, stride=1,
                                        padding=self.pool // 2)[..., :n]

    def target(self, seq, state, movable, keep, block) -> tuple[int, bool] | None:
        if state.snapped:
            return super().target(seq, state, movable, keep, block)
        if seq.num_computed_tokens < len(seq.prompt_token_ids):
            return None  # it waits for the end of the prompt and its observation window
        # The snapshot: the prompt gets half the budget, generated tokens the other half.
        state.snapped = True
        state.prompt_kept = min(movable, keep // 2)
        return state.prompt_kept, True

    def select(self, state, start, end, keep, shape, snapshot) -> torch.Tensor:
        if not snapshot:
            kept = state.prompt_kept
            return _shared(torch.arange(start, start + kept), end - (keep - kept), end, shape)
        return _heavy_and_recent(state.scores, start, end, keep, min(self.window, keep), shape)


_POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Streaming, H2O, Scissorhands, SnapKV)}


def parse_policy(name: str | None) -> Policy | None:
    """A policy by name (None or "none" = no eviction); a clear error for anything else."""
    key = policy_name(name)
    return None if key == "none" else _POLICIES[key]()


@dataclass
class KVState:
    """One sequence's eviction state: its policy, budget and per-token attention scores."""

    policy: Policy
    budget: int
    scores: torch.Tensor | None = None  # [layers, kv_heads, kv_len] float32
    snapped: bool = False  # SnapKV has compressed the prompt
    prompt_kept: int = 0  # SnapKV: prompt tokens its snapshot kept
    evicted: int = 0
    compactions: int = 0

    def restart(self) -> KVState:
        """A fresh state for a preempted sequence that will be recomputed from its first token."""
        return KVState(self.policy, self.budget)


class KVEvictor(StepFeature):
    """Observes attention statistics and compacts sequences' caches (a step feature of the
    engine core: requests may choose a policy even where the engine has none)."""

    def __init__(self, runner, block_manager) -> None:
        self.runner = runner
        self.bm = block_manager
        self.tokens_evicted = 0

    # ---- step hooks ----
    def wants_mass(self, scheduled: list) -> bool:
        return any(s.seq.kv is not None and s.seq.kv.policy.wants_mass(s.seq.kv)
                   for s in scheduled)

    def after_append(self, step: Step) -> int:
        """After acceptance: fold in attention statistics, compact sequences over budget."""
        masses = step.result.mass
        evicted = 0
        for i, s in enumerate(step.scheduled):
            seq = s.seq
            if seq.kv is None or seq.is_finished or seq.status is not Status.RUNNING:
                continue
            self.observe(seq, None if masses is None else masses[i])
            evicted += self.maybe_compact(seq)
        return evicted

    def on_preempt(self, seq: Sequence) -> None:
        """Recomputed from its first token: nothing evicted yet, positions from 0."""
        seq.num_evicted = seq.position_offset = 0
        if seq.kv is not None:
            seq.kv = seq.kv.restart()

    def observe(self, seq: Sequence, mass: torch.Tensor | None) -> None:
        """Fold one step's attention mass ([layers, kv_heads, >= kv_len]) into the scores."""
        state: KVState = seq.kv
        n = seq.kv_len
        if not state.policy.wants_mass(state):
            return
        scores = state.scores
        if scores is None or scores.shape[-1] < n:
            grow = n - (0 if scores is None else scores.shape[-1])
            pad = torch.zeros(*self._score_shape(), grow)
            scores = pad if scores is None else torch.cat((scores, pad), dim=-1)
        state.scores = scores[..., :n]
        if mass is not None:
            state.policy.score(state, mass[..., :n].float().cpu(), seq)

    def maybe_compact(self, seq: Sequence) -> int:
        """Bring the sequence back to its budget if it went a block over; tokens evicted."""
        state: KVState = seq.kv
        protected = seq.num_cached_blocks * self.bm.block_size
        keep = max(state.budget - protected, 0)
        movable = seq.kv_len - protected
        plan = state.policy.target(seq, state, movable, keep, self.bm.block_size)
        if plan is None:
            return 0
        keep, snapshot = plan
        if movable > keep:
            chosen = state.policy.select(state, protected, seq.kv_len, keep, self._score_shape(),
                                         snapshot)
            self._move(seq, protected, chosen)
        if state.snapped:
            state.scores = None  # SnapKV's statistics served their one snapshot
        if movable <= keep:
            return 0
        evicted = movable - keep
        seq.num_evicted += evicted
        if state.policy.repositions:
            seq.position_offset = 0
        else:
            seq.position_offset += evicted
        self.bm.trim(seq, seq.kv_len)
        state.evicted += evicted
        state.compactions += 1
        self.tokens_evicted += evicted
        return evicted

    # ---- moving the kept tokens ----
    def _move(self, seq: Sequence, start: int, chosen: torch.Tensor) -> None:
        """Copy each head's kept tokens to cache indices start.. and carry the scores along."""
        bs = self.bm.block_size
        table = torch.tensor(seq.block_table, dtype=torch.long)

        def slots(idx: torch.Tensor) -> torch.Tensor:
            return table[idx // bs] * bs + idx % bs

        keep = chosen.shape[-1]
        dst_idx = torch.arange(start, start + keep)
        delta = None
        if seq.kv.policy.repositions:
            # Shared selection: one position change per kept token, new position = new index.
            delta = dst_idx - chosen[0, 0]
        self.runner.move_kv(slots(chosen), slots(dst_idx), delta)
        state = seq.kv
        if state.scores is not None:
            kept = state.scores.gather(-1, chosen)
            state.scores = torch.cat((state.scores[..., :start], kept), dim=-1)

    def _score_shape(self) -> tuple[int, int]:
        c = self.runner.model.config
        return c.num_layers, c.num_kv_heads


def _heavy_and_recent(scores: torch.Tensor, start: int, end: int, keep: int, recent: int,
                      shape: tuple[int, int]) -> torch.Tensor:
    """Per layer and head, the `keep - recent` best-scored indices from `start` on, plus the
    last `recent`."""
    top = scores[..., start : end - recent].topk(keep - recent, dim=-1).indices + start
    tail = torch.arange(end - recent, end).expand(*shape, recent)
    return torch.cat((top.sort(dim=-1).values, tail), dim=-1)


def _shared(head: torch.Tensor, tail_from: int, end: int, shape: tuple[int, int]) -> torch.Tensor:
    """The same kept indices for every layer and head: `head` plus the range tail_from..end."""
    idx = torch.cat((head, torch.arange(tail_from, end)))
    return idx.expand(*shape, idx.shape[0])
