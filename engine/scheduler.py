"""Continuous batching: which sequences run in the next step, and with how many tokens each."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    """A sequence and the number of its tokens this step computes (a prefill chunk or 1).

    `samples` (this step reaches the sequence's last token, so a token is sampled) and
    `is_decode` are fixed when the step is planned: the sequence itself moves on afterwards.
    """

    seq: Sequence
    num_new_tokens: int
    num_draft: int = 0  # of the new tokens, how many are unverified drafts at the end
    samples: bool = field(init=False)
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        seq, n = self.seq, self.num_new_tokens - self.num_draft
        self.samples = seq.num_computed_tokens + n == seq.num_tokens
        self.is_decode = n == 1 and seq.num_computed_tokens >= len(seq.prompt_token_ids)


@dataclass
class SchedulerOutput:
    """One step's work: the scheduled sequences and those preempted to make room."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queries: int = 0  # tokens of newly admitted sequences looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found (not recomputed)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)


class Scheduler:
    """Waiting and running queues; running sequences first, then admission while KV blocks last.

    Each step mixes decode tokens of running sequences with prefill chunks of new ones, within a
    token budget (`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`). When a running
    sequence needs a block and none is free, the most recently admitted sequence is preempted:
    its blocks are freed and it goes back to the front of the queue to be recomputed later.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_cache=None,
                 on_preempt: Callable[[Sequence], None] | None = None) -> None:
        self.block_manager = block_manager
        self.prefix_cache = prefix_cache
        # The features' resets for a preempted sequence (engine/features.py: on_preempt).
        self.on_preempt = on_preempt
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = _chunk(seq, budget)
            # Drafts ride along as extra query tokens when the budget has room for them.
            drafts = len(seq.draft_tokens) if n == seq.num_uncomputed_tokens == 1 else 0
            drafts = min(drafts, budget - n)
            if seq.max_chunk_tokens is not None:
                drafts = min(drafts, seq.max_chunk_tokens - n)
            if drafts and not bm.can_append(seq, n + drafts):
                drafts = 0  # drafts ride only in free blocks: they never preempt a request
            n += drafts
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n, drafts))
                budget -= n
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        cache = self.prefix_cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.prompt_source is not None and not seq.block_table and not self._fork(seq):
                break  # its source computes the shared prompt this step: admitted next step
            if cache is not None and not seq.block_table:
                cache.match(seq)
            n = _chunk(seq, budget)
            if not bm.can_append(seq, n):
                if cache is not None:
                    cache.unmatch(seq)
                break
            if cache is not None:
                queried, hit = cache.count(seq)
                out.prefix_queries += queried
                out.prefix_hits += hit
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            bm.append_slots(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _fork(self, seq: Sequence) -> bool:
        """Share the full prompt blocks of the sequence's source (another choice of its request)
        if the source has computed them; False while the source is still computing them.

        Full blocks are never written again (new tokens go to later blocks, rejected drafts are
        trimmed from the tail), so sharing them needs no copy. At least one prompt token is
        left to compute: its logits choose this choice's first token. A source that has gone,
        was preempted, or may move its blocks (an eviction policy) is not waited for.
        """
        source = seq.prompt_source
        full = (len(seq.prompt_token_ids) - 1) // self.block_manager.block_size
        usable = (full > 0 and source.status == Status.RUNNING and source.kv is None
                  and seq.kv is None)
        if not usable:  # (a waiting source is behind this one: waiting for it would deadlock)
            seq.prompt_source = None
            return True
        if source.num_computed_tokens < full * self.block_manager.block_size:
            return False  # running, so it gets there
        self.block_manager.share(seq, source.block_table[:full])
        seq.num_computed_tokens = full * self.block_manager.block_size
        seq.prompt_source = None  # shared once; a preempted fork recomputes alone
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to be recomputed later."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        if self.on_preempt is not None:
            self.on_preempt(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues for good and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason


def _chunk(seq: Sequence, budget: int) -> int:
    """Tokens of the sequence to compute this step: what is left, within the step's budget and
    the sequence's own limit."""
    limit = budget if seq.max_chunk_tokens is None else min(budget, seq.max_chunk_tokens)
    return min(seq.num_uncomputed_tokens, limit)
