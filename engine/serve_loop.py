"""The engine loop behind the server: one thread owns the LLM and steps every request in flight.

The loop is supervised: an error outside the engine's own isolation (engine/llm.py runs a failed
step's requests one by one, failing only those that fail alone) ends the requests in flight with
an error, is logged with its traceback, and the loop goes on. If the engine cannot step at all,
the loop says so (`health()`), the server answers 503 and refuses new work, and nothing waits
forever on a thread that has stopped.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.logprobs import prompt_logprobs
from engine.sequence import RequestError, SamplingParams, StreamDelta
from engine.teacher_forcing import ForcedTokens

log = logging.getLogger("servescope.serve")


@dataclass
class Admitted:
    """Sent first to a request the engine accepted (before any token): the server can answer
    200 and open a stream, knowing the request will run. Carries the prompt's log-probabilities
    when the request asked for them."""

    prompt_logprobs: list | None = None


@dataclass
class Submission:
    """A request handed to the loop, and how its replies go back (called on the loop thread
    with Admitted, then StreamDelta objects, the last with `output` set, or a RequestError)."""

    prompt: str | list[int]
    params: SamplingParams
    deliver: Callable[[object], None]
    request_id: str = ""
    arrival: float | None = None  # time.perf_counter() when the request reached the server
    prompt_logprobs: int | None = None  # top-k per prompt token, when asked (vLLM's field)
    share_prompt_with: str | None = None  # another choice's request id (n > 1)
    # Prompt tokens from this index on are scored by decoding them (ScoringRun), not by prefill.
    decode_from: int | None = None


@dataclass
class ScoringRun:
    """A prompt scored as a conversation that long sees it: its first `decode_from` tokens
    prefilled, every later one decoded with the true token forced in, through the request's own
    KV cache (its eviction policy and budget, the server's KV dtype), so what a long reply
    would lose to eviction or quantization shows in the scores. The request itself runs once
    the scoring is done, with the scores as its prompt log-probabilities."""

    sub: Submission
    prefilled: list  # the first decode_from positions' scores, from a prefill
    forced: ForcedTokens  # the engine's record of the decoded positions


class EngineLoop:
    """Continuous batching across HTTP requests: handlers submit, the loop thread steps.

    The LLM is not thread-safe, so only this thread touches it; handlers talk to it through
    the inbox and their own deliver callbacks.
    """

    def __init__(self, llm, metrics=None) -> None:
        self.llm = llm
        self.metrics = metrics
        self._inbox: queue.Queue[Submission | None] = queue.Queue()
        self._live: dict[str, Submission] = {}
        # Submissions whose prompt log-probabilities wait for free KV blocks.
        self._deferred: list[Submission] = []
        self._scoring: dict[str, ScoringRun] = {}  # by the scoring request's engine id
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._broken: str | None = None
        self._trimmer = HeapTrimmer()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        """Step on a thread of the loop's own."""
        self._thread.start()
        return self

    def run_here(self, when_ready: Callable[[], None] = lambda: None) -> None:
        """Step on the calling thread until stop() or an interrupt (Ctrl+C: KeyboardInterrupt
        propagates once the requests in flight are ended). `when_ready` is called once the
        loop counts as running (health() is None), before the first step: start serving there."""
        self._thread = threading.current_thread()
        when_ready()
        self._run()

    def stop_soon(self) -> None:
        """Ask the loop to stop after its current step, without waiting."""
        self._stop.set()
        self._inbox.put(None)  # wake the loop if it sleeps

    def stop(self) -> None:
        """Stop stepping and wait for the thread; requests in flight end with an error."""
        self.stop_soon()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def health(self) -> str | None:
        """None while the loop can serve, else why not (one sentence)."""
        if self._broken is not None:
            return self._broken
        if not self._thread.is_alive():
            return "The engine loop has stopped: restart the server."
        return None

    @property
    def in_flight(self) -> int:
        return len(self._live) + len(self._scoring)

    def submit(self, prompt: str | list[int], params: SamplingParams,
               deliver: Callable[[object], None], arrival: float | None = None,
               prompt_logprobs: int | None = None,
               share_prompt_with: str | None = None,
               decode_from: int | None = None) -> Submission:
        sub = Submission(prompt, params, deliver, f"srv-{next(self._ids)}", arrival,
                         prompt_logprobs, share_prompt_with, decode_from)
        reason = self.health()
        if reason is not None:
            _safe_deliver(sub, RequestError(reason))
        else:
            self._inbox.put(sub)
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away (LLM.abort is thread-safe)."""
        self.llm.abort(request_id)
        self.llm.abort(_scoring_id(request_id))

    # ---- the loop thread ----
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iteration()
                except Exception as exc:  # noqa: BLE001 - supervised: log, fail, go on
                    log.exception("The engine loop failed; the requests in flight were ended")
                    self._recover(exc)
        finally:
            self._fail_live("The server is shutting down: retry on another server.")
            self._drain_inbox("The server is shutting down: retry on another server.")

    def _iteration(self) -> None:
        self._trimmer.maybe_trim()
        self._admit(block=not self.llm.has_unfinished() and not self._deferred)
        if self._broken is not None:
            self._drain_inbox(self._broken)
            return
        if self.llm.has_unfinished():
            self._step()

    def _admit(self, block: bool) -> None:
        deferred, self._deferred = self._deferred, []
        for sub in deferred:
            self._add(sub)
        try:
            sub = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while sub is not None:
            self._add(sub)
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                sub = None

    def _add(self, sub: Submission, scored: list | None = None) -> None:
        try:
            if sub.prompt_logprobs is not None and scored is None:
                if not self._room_for_prompt(sub):
                    self._deferred.append(sub)
                    return
                if sub.decode_from is not None:
                    self._start_scoring(sub)
                    return
                scored = self._prompt_logprobs(sub)
            self.llm.add_request(sub.prompt, sub.params, request_id=sub.request_id,
                                 arrival=sub.arrival, share_prompt_with=sub.share_prompt_with)
        except RequestError as exc:
            _safe_deliver(sub, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a prompt the engine chokes on fails alone
            log.exception("Admitting request %s failed", sub.request_id)
            _safe_deliver(sub, RequestError(f"The engine could not take this request "
                                            f"({type(exc).__name__}: {exc})."))
            return
        self._live[sub.request_id] = sub
        _safe_deliver(sub, Admitted(scored))

    def _room_for_prompt(self, sub: Submission) -> bool:
        """Whether the KV pool can hold the whole prompt now (its log-probabilities come from
        one prefill of its own); if it never could, the engine's own check says so."""
        bm = self.llm.block_manager
        need = bm.blocks_needed(len(sub.prompt))
        return need <= bm.num_free_blocks or need > bm.num_blocks

    def _prompt_logprobs(self, sub: Submission, upto: int | None = None) -> list:
        """The prompt's (first `upto` tokens') log-probabilities from LLM.prompt_logits, on
        this thread (the engine's owner), before the request joins the batch."""
        prompt = list(sub.prompt)[:upto]
        return prompt_logprobs(self.llm.prompt_logits(prompt), prompt, sub.prompt_logprobs)

    def _start_scoring(self, sub: Submission) -> None:
        """Score the prompt by decoding (ScoringRun): a request of its own in the batch, under
        the submission's KV policy and budget; _deliver adds the real request when it ends."""
        prompt, start = list(sub.prompt), sub.decode_from
        params = SamplingParams(temperature=0.0, max_tokens=len(prompt) - start,
                                ignore_eos=True, kv_policy=sub.params.kv_policy,
                                kv_budget=sub.params.kv_budget)
        rid = _scoring_id(sub.request_id)
        self.llm.add_request(prompt[:start], params, request_id=rid, arrival=sub.arrival,
                             forced_tokens=prompt[start:], forced_top_k=sub.prompt_logprobs)
        prefilled = self._prompt_logprobs(sub, upto=start)
        self._scoring[rid] = ScoringRun(sub, prefilled, self.llm.sequence(rid).forced)

    def _step(self) -> None:
        deltas, stats = self.llm.step_deltas()
        if self.metrics is not None:
            self.metrics.observe_step(stats)
        for delta in deltas:
            self._deliver(delta)

    def _deliver(self, delta: StreamDelta) -> None:
        if delta.request_id in self._scoring:
            self._scored(delta)
            return
        sub = self._live.get(delta.request_id)
        if sub is None:
            return
        if delta.output is not None:
            del self._live[delta.request_id]
            if self.metrics is not None:
                self.metrics.observe_finished(delta.output)
            if delta.output.error is not None:
                _safe_deliver(sub, RequestError(delta.output.error))
                return
        _safe_deliver(sub, delta)

    def _scored(self, delta: StreamDelta) -> None:
        """A scoring run's step: nothing for the client until it ends; then the request runs
        with the prefilled and the decoded scores as its prompt log-probabilities."""
        if delta.output is None:
            return
        run = self._scoring.pop(delta.request_id)
        if delta.output.error is not None:
            _safe_deliver(run.sub, RequestError(delta.output.error))
            return
        if len(run.forced.scored) != len(run.forced.tokens):  # aborted: the client went away
            _safe_deliver(run.sub, RequestError("The request was cancelled while its prompt "
                                                "was being scored."))
            return
        self._add(run.sub, scored=run.prefilled + run.forced.scored)

    def _recover(self, exc: Exception) -> None:
        """End every request in flight and check the engine can still step; if it cannot,
        the loop is broken and says why (before the requests hear of it, so their answer can
        say whether to retry here)."""
        for rid in [*self._live, *self._scoring]:
            self.llm.abort(rid)
        try:
            for _ in range(3):  # applies the aborts so the blocks are freed
                if not self.llm.has_unfinished():
                    break
                self.llm.step()
        except Exception as again:  # noqa: BLE001
            self._broken = (f"The engine cannot step any more ({type(again).__name__}: "
                            f"{again}): restart the server.")
            log.error("%s", self._broken)
        self._fail_live(self._broken or f"The engine failed ({type(exc).__name__}: {exc}); "
                                         "the request was dropped: retry it.")

    def _fail_live(self, message: str) -> None:
        live, self._live = self._live, {}
        scoring, self._scoring = self._scoring, {}
        for sub in [*live.values(), *(run.sub for run in scoring.values())]:
            _safe_deliver(sub, RequestError(message))

    def _drain_inbox(self, message: str) -> None:
        deferred, self._deferred = self._deferred, []
        for sub in deferred:
            _safe_deliver(sub, RequestError(message))
        while True:
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                return
            if sub is not None:
                _safe_deliver(sub, RequestError(message))


def _scoring_id(request_id: str) -> str:
    return f"{request_id}/score"


def _safe_deliver(sub: Submission, item: object) -> None:
    """A reply for a client that has gone (its event loop closed) is dropped, not raised on the
    engine thread."""
    try:
        sub.deliver(item)
    except Exception:  # noqa: BLE001
        log.debug("Dropped a reply for %s", sub.request_id, exc_info=True)


class HeapTrimmer:
    """Gives freed heap memory back to the operating system now and then (glibc's
    malloc_trim). Steps of many different token counts free activations of many sizes; glibc
    keeps the freed pages, so resident memory crept up by hundreds of MB over a long serve run
    (a 300-shape sweep: +600 MB, of which malloc_trim returns 270). Elsewhere a no-op."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last = time.monotonic()
        self._trim = _malloc_trim()

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.every_s:
            self._last = now
            self._trim(0)


def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
