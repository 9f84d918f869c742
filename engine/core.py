"""The engine core: one step loop, schedule → execute → update.

    aborts ─► features.before_schedule ─► scheduler.schedule ─► runner.run ─► StepResult
       ─► choose tokens (features.choose: verify drafts, force tokens; the rest sampled)
       ─► advance computed counts ─► features.after_forward (index prefix blocks, commit
          accepted drafts) ─► output processor (append, detokenize, stop) ─► features.after_append
          (evict KV) ─► StepStats to the observers

Features (engine/features.py) plug into the step through hooks; the core knows none of them
by name. A failed step is isolated: each sequence of the batch is recomputed alone, and only
those that fail alone end with finish_reason "error".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.features import Step, StepFeature
from engine.output_processor import OutputProcessor
from engine.runner import ModelRunner
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import RequestError, Sequence, Status

log = logging.getLogger("servescope.engine")


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, from the engine's own clock."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    kv_blocks_used: int
    kv_blocks_total: int
    wall_s: float
    timestamp: float
    num_evicted_tokens: int = 0  # KV entries dropped by eviction policies this step
    # Requests recomputed one by one because the batch step failed (EngineCore._isolate): a
    # bug that keeps failing steps shows here, not only as a slow engine.
    num_isolated: int = 0


class EngineCore:
    """Owns the requests in flight and runs their steps; LLM (engine/llm.py) is its facade."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, scheduler: Scheduler,
                 features: list[StepFeature], tokenizer, max_model_len: int) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.output = OutputProcessor(tokenizer, max_model_len, self.finish)
        self.features = features
        scheduler.on_preempt = self._reset_features
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._abort_lock = threading.Lock()
        self._to_abort: set[str] = set()
        self.last_stats: StepStats | None = None
        # Called with every step's StepStats on the stepping thread (the app's live chart).
        self.step_observers: list[Callable[[StepStats], None]] = []

    # ---- requests ----
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise RequestError(f"Request id '{seq.request_id}' is already in use: pick another "
                               "id.")
        self.seqs[seq.request_id] = seq
        self.output.add(seq)
        self.scheduler.add(seq)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its blocks; safe to call from any thread."""
        with self._abort_lock:
            self._to_abort.add(request_id)

    def finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.metrics.finished = now

    def abort_all(self) -> None:
        """End every request in flight now (closing the engine)."""
        for rid in list(self.seqs):
            self.abort(rid)
        self._apply_aborts()

    # ---- the step ----
    def step(self) -> tuple[list[Sequence], StepStats]:
        """One iteration; the sequences it updated and what it did."""
        try:
            return self._run_step()
        except Exception as exc:  # one request's failure must not end the others
            return self._isolate(exc)

    def _run_step(self, apply_aborts: bool = True) -> tuple[list[Sequence], StepStats]:
        start = time.perf_counter()
        # A step run alone (see _isolate) leaves aborts for later: the queues are set aside.
        updated = self._apply_aborts() if apply_aborts else []
        for f in self.features:
            f.before_schedule(self.scheduler.running)
        step = Step(self.scheduler.schedule())
        generated = accepted = evicted = 0
        if step.scheduled:
            self._execute(step, start)
            for s in step.scheduled:
                # Drafts count as computed only once accepted (the spec feature's after_forward).
                s.seq.num_computed_tokens += s.num_new_tokens - s.num_draft
            for f in self.features:
                f.after_forward(step)
            logits = step.result.logits
            for s, tokens, row in zip(step.sampling, step.tokens, step.rows, strict=False):
                # The rows the tokens were chosen from: their log-probabilities, if asked.
                rows = logits[row : row + len(tokens)]
                generated += self.output.append(s.seq, tokens, step.now, rows)
                accepted += len(tokens) - 1
                updated.append(s.seq)
            evicted = sum(f.after_append(step) for f in self.features)
        for seq in updated:
            if seq.is_finished:
                self.seqs.pop(seq.request_id, None)
        self.last_stats = self._stats(step.plan, updated, start, generated, accepted, evicted)
        for observe in self.step_observers:
            observe(self.last_stats)
        return updated, self.last_stats

    def _execute(self, step: Step, start: float) -> None:
        """The forward pass and the tokens chosen from it."""
        for s in step.scheduled:
            if s.seq.metrics.first_scheduled is None:
                s.seq.metrics.first_scheduled = start
        want_mass = any(f.wants_mass(step.scheduled) for f in self.features)
        step.result = self.runner.run(step.scheduled, want_mass=want_mass)
        step.tokens = self._choose_tokens(step, step.result.logits)
        step.now = time.perf_counter()

    def _choose_tokens(self, step: Step, logits: torch.Tensor) -> list[list[int]]:
        """New tokens per sampling sequence: what a feature chose, else one sampled."""
        sampling, rows = step.sampling, step.rows
        chosen: list[list[int] | None] = [None] * len(sampling)
        for f in self.features:
            f.choose(step, logits, rows, chosen)
        plain = [i for i, c in enumerate(chosen) if c is None]
        if plain:
            picked = [rows[i] for i in plain]
            # Every row in order (a decode step without drafts): no copy of the logits (at 16
            # sequences the copy cost 0.25 ms of the demo model's 35 ms step).
            own = logits if picked == list(range(logits.shape[0])) else logits[picked]
            tokens = sample(own, [sampling[i].seq for i in plain])
            for i, token in zip(plain, tokens, strict=True):
                chosen[i] = [token]
        return chosen

    def _reset_features(self, seq: Sequence) -> None:
        for f in self.features:
            f.on_preempt(seq)

    # ---- isolation: a failed step fails only the requests that fail alone ----
    def _isolate(self, exc: Exception) -> tuple[list[Sequence], StepStats]:
        """After a failed step, recompute each sequence of the batch alone: those that fail
        alone end with finish_reason "error"; the others go on. Costs a recompute of the batch,
        only when a step fails."""
        start = time.perf_counter()
        suspects = list(self.scheduler.running)
        # Said aloud: the batch is recomputed request by request, which is slow, so a bug that
        # keeps failing steps would otherwise show only as a mysteriously slow engine.
        log.warning("A step of %d requests failed (%s: %s); each is recomputed alone",
                    len(suspects), type(exc).__name__, exc)
        # Sequences the failed step finished before it broke still owe their last delta.
        updated = [seq for seq in self.seqs.values() if seq.is_finished]
        if not suspects and not updated:
            raise exc
        for seq in suspects:
            self.scheduler.preempt(seq)  # frees its blocks and resets it to be recomputed
            self.scheduler.waiting.remove(seq)
        stats = None
        for seq in suspects:
            alone, stats = self._run_alone(seq)
            updated.extend(alone)
        updated = list(dict.fromkeys(updated))
        for seq in updated:
            if seq.is_finished:
                self.seqs.pop(seq.request_id, None)
        if stats is None:
            stats = self._stats(SchedulerOutput(), updated, start, 0, 0)
        self.last_stats = stats = dataclasses.replace(stats, num_isolated=len(suspects))
        return updated, stats

    def _run_alone(self, seq: Sequence) -> tuple[list[Sequence], StepStats | None]:
        """Step one sequence with the others set aside until it samples a token, finishes or
        fails; then put the queues back together."""
        sched = self.scheduler
        saved_running, saved_waiting = sched.running, sched.waiting
        sched.running, sched.waiting = [], deque([seq])
        updated, stats, before = [], None, len(seq.output_token_ids)
        chunk = seq.max_chunk_tokens or sched.max_num_batched_tokens
        try:
            for _ in range(-(-seq.num_tokens // chunk) + 1):
                alone, stats = self._run_step(apply_aborts=False)
                updated.extend(alone)
                if seq.is_finished or len(seq.output_token_ids) > before:
                    break
        except Exception as exc:
            self._fail(seq, exc)
            updated.append(seq)
        finally:
            saved_running.extend(sched.running)
            saved_waiting.extendleft(reversed(sched.waiting))
            sched.running, sched.waiting = saved_running, saved_waiting
        return updated, stats

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.error = (f"The engine failed on this request ({type(exc).__name__}: {exc}); other "
                     "requests were not affected.")
        self.finish(seq, "error", time.perf_counter())

    def _apply_aborts(self) -> list[Sequence]:
        with self._abort_lock:
            rids, self._to_abort = self._to_abort, set()
        aborted = []
        for rid in rids:
            seq = self.seqs.get(rid)
            if seq is not None and seq.status is not Status.FINISHED:
                self.finish(seq, "abort", time.perf_counter())
                aborted.append(seq)
        return aborted

    def _stats(self, plan: SchedulerOutput, updated: list[Sequence], start: float,
               generated: int, accepted: int, evicted: int = 0) -> StepStats:
        bm = self.block_manager
        return StepStats(
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_generated_tokens=generated,
            num_draft_tokens=sum(s.num_draft for s in plan.scheduled),
            num_accepted_tokens=accepted,
            prefix_cache_queries=plan.prefix_queries,
            prefix_cache_hits=plan.prefix_hits,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(plan.preempted),
            num_finished=sum(1 for s in updated if s.is_finished),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            wall_s=time.perf_counter() - start,
            timestamp=start,
            num_evicted_tokens=evicted,
        )
