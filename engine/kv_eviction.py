"""KV-cache eviction: keep only the cached tokens attention still uses, within a token budget.

Policies (one interface, chosen per engine or per request):

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

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.sequence import RequestError, Sequence

POLICIES = ("none", "streaming", "h2o", "scissorhands", "snapkv")
_ALIASES = {"streamingllm": "streaming", "heavy-hitter": "h2o", "off": "none"}


@dataclass(frozen=True)
class Policy:
    """An eviction policy and its constants (the papers' defaults)."""

    name: str
    sinks: int = 4  # StreamingLLM's attention sinks
    recent_fraction: float = 0.5  # H2O / Scissorhands: half recent window, half heavy hitters
    window: int = 32  # SnapKV's observation window
    pool: int = 7  # SnapKV's max-pool kernel
    decay: float = 1.0 - 1.0 / 64  # Scissorhands: a history window of about 64 steps

    @property
    def needs_mass(self) -> bool:
        return self.name in ("h2o", "scissorhands", "snapkv")

    def wants_mass(self, state: KVState) -> bool:
        """Whether this step's attention statistics are needed (SnapKV: only until it snaps)."""
        return self.needs_mass and not (self.name == "snapkv" and state.snapped)

    def mass_rows(self, seq: Sequence, num_new: int) -> int | None:
        """SnapKV sums only the queries of its observation window, the prompt's last `window`:
        of a chunk of `num_new` tokens from `seq.num_computed_tokens` on, its last rows that
        fall in the window (the window may span chunks: the prompt may end in a tiny one)."""
        if self.name != "snapkv":
            return None
        end = seq.num_computed_tokens + num_new
        prompt_len = len(seq.prompt_token_ids)
        if end > prompt_len:  # a recompute chunk past the prompt: its own last queries
            return min(self.window, num_new)
        return min(num_new, max(0, end - (prompt_len - self.window)))

    @property
    def repositions(self) -> bool:
        return self.name == "streaming"

def parse_policy(name: str | None) -> Policy | None:
    """A policy by name (None or "none" = no eviction); a clear error for anything else."""
    if name is None:
        return None
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in POLICIES:
        raise RequestError(f"Unknown KV eviction policy '{name}': choose one of "
                           f"{', '.join(POLICIES)}.")
    return None if key == "none" else Policy(key)


def resolve_budget(budget: int | float | None, total_tokens: int, block_size: int) -> int:
    """The budget in tokens: an int is tokens, a float in (0, 1] a fraction of the request's
    full length (prompt + max_tokens), as kvpress states compression ratios."""
    if budget is None:
        raise RequestError("A KV eviction policy needs kv_budget: tokens (e.g. 512) or a "
                           "fraction of the request's length (e.g. 0.2).")
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise RequestError(f"kv_budget must be a number of tokens or a fraction, got {budget!r}.")
    minimum = 2 * block_size
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise RequestError(f"kv_budget as a fraction must be in (0, 1], got {budget}.")
        # A fraction of a short request may come out below the minimum: round it up.
        return max(math.ceil(budget * total_tokens), minimum)
    tokens = budget
    if tokens < minimum:
        raise RequestError(f"kv_budget of {tokens} tokens is below the minimum of {minimum} "
                           f"(two KV blocks): raise kv_budget.")
    return tokens


@dataclass
class KVState:
    """One sequence's eviction state: its policy, budget and per-token attention scores."""

    policy: Policy
    budget: int
    scores: torch.Tensor | None = None  # [layers, kv_heads, kv_len] float32
    snapped: bool = False  # SnapKV has compressed the prompt
    evicted: int = 0
    compactions: int = 0
    extra: dict = field(default_factory=dict)

    def restart(self) -> KVState:
        """A fresh state for a preempted sequence that will be recomputed from its first token."""
        return KVState(self.policy, self.budget)


class KVEvictor:
    """Observes attention statistics and compacts sequences' caches; owned by the LLM."""

    def __init__(self, runner, block_manager) -> None:
        self.runner = runner
        self.bm = block_manager
        self.tokens_evicted = 0

    def observe(self, seq: Sequence, mass: torch.Tensor | None) -> None:
        """Fold one step's attention mass ([layers, kv_heads, >= kv_len]) into the scores."""
        state: KVState = seq.kv
        n = seq.kv_len
        if not state.policy.needs_mass or (state.policy.name == "snapkv" and state.snapped):
            return
        scores = state.scores
        if scores is None or scores.shape[-1] < n:
            grow = n - (0 if scores is None else scores.shape[-1])
            pad = torch.zeros(*self._score_shape(), grow)
            scores = pad if scores is None else torch.cat((scores, pad), dim=-1)
        state.scores = scores[..., :n]
        if mass is None:
            return
        mass = mass[..., :n].float().cpu()
        name = state.policy.name
        if name == "h2o":
            state.scores += mass
        elif name == "scissorhands":
            important = (mass > mass.mean(dim=-1, keepdim=True)).float()
            state.scores.mul_(state.policy.decay).add_(important)
        elif name == "snapkv":
            # Chunks before the window bring zeros; at the prompt's end the window's summed
            # attention is max-pooled over neighbours.
            state.scores += mass
            if seq.num_computed_tokens >= len(seq.prompt_token_ids):
                p = state.policy.pool
                state.scores = F.max_pool1d(state.scores, p, stride=1, padding=p // 2)[..., :n]

    def maybe_compact(self, seq: Sequence) -> int:
        """Bring the sequence back to its budget if it went a block over; tokens evicted."""
        state: KVState = seq.kv
        protected = seq.num_cached_blocks * self.bm.block_size
        keep = max(state.budget - protected, 0)
        movable = seq.kv_len - protected
        snapshot = state.policy.name == "snapkv" and not state.snapped
        if snapshot:
            if seq.num_computed_tokens < len(seq.prompt_token_ids):
                return 0  # SnapKV waits for the end of the prompt and its observation window
            # The snapshot: the prompt gets half the budget, generated tokens the other half.
            state.snapped = True
            state.extra["prompt_kept"] = min(movable, keep // 2)
            keep = state.extra["prompt_kept"]
        elif movable <= keep + self.bm.block_size:
            # (Not kv_len <= budget + a block: with a shared prefix longer than the budget that
            # would compact at every step instead of once per block.)
            return 0
        if movable > keep:
            chosen = self._select(seq, protected, keep, snapshot)  # [layers, kv_heads, keep]
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

    # ---- selection ----
    def _select(self, seq: Sequence, start: int, keep: int,
                snapshot: bool = False) -> torch.Tensor:
        """The cache indices each layer and KV head keeps, ascending ([layers, kv_heads, keep]);
        `snapshot`: SnapKV's one compression of the prompt."""
        state, policy = seq.kv, seq.kv.policy
        end = seq.kv_len
        shape = self._score_shape()
        if policy.name == "streaming":
            sinks = max(0, min(policy.sinks - start, keep))
            return _shared(torch.arange(start, start + sinks), end - (keep - sinks), end, shape)
        if policy.name == "snapkv":
            kept = state.extra["prompt_kept"]
            if not snapshot:  # afterwards the compressed prompt stays and generated tokens slide
                return _shared(torch.arange(start, start + kept), end - (keep - kept), end, shape)
            recent = min(policy.window, keep)
        else:
            recent = min(keep, int(keep * policy.recent_fraction))
        heavy = keep - recent
        top = state.scores[..., start : end - recent].topk(heavy, dim=-1).indices + start
        tail = torch.arange(end - recent, end).expand(*shape, recent)
        return torch.cat((top.sort(dim=-1).values, tail), dim=-1)

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


def _shared(head: torch.Tensor, tail_from: int, end: int, shape: tuple[int, int]) -> torch.Tensor:
    """The same kept indices for every layer and head: `head` plus the range tail_from..end."""
    idx = torch.cat((head, torch.arange(tail_from, end)))
    return idx.expand(*shape, idx.shape[0])
