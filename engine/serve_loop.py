"""The engine loop behind the server: one thread owns the LLM and steps every request in flight."""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass

from engine.sequence import RequestError, SamplingParams, StreamDelta


@dataclass
class Submission:
    """A request handed to the loop, and the queue its deltas (or an error) come back on."""

    prompt: str | list[int]
    params: SamplingParams
    replies: queue.Queue
    request_id: str = ""


class EngineLoop:
    """Continuous batching across HTTP requests: handlers submit, the loop thread steps.

    The LLM is not thread-safe, so only this thread touches it; handler threads talk to it
    through queues. A request's reply queue receives StreamDelta objects and finally either a
    delta with `output` set or a RequestError.
    """

    def __init__(self, llm, metrics=None) -> None:
        self.llm = llm
        self.metrics = metrics
        self._inbox: queue.Queue[Submission] = queue.Queue()
        self._replies: dict[str, queue.Queue] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop stepping and wait for the thread; requests in flight end with an error."""
        self._stop.set()
        self._inbox.put(None)  # wake the loop if it sleeps
        self._thread.join(timeout=30)

    def submit(self, prompt: str | list[int], params: SamplingParams) -> Submission:
        sub = Submission(prompt, params, queue.Queue(), f"srv-{next(self._ids)}")
        self._inbox.put(sub)
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away (LLM.abort is thread-safe)."""
        self.llm.abort(request_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self.llm.has_unfinished())
            if self.llm.has_unfinished():
                self._step()
        for replies in self._replies.values():
            replies.put(RequestError("The server is shutting down: retry on another server."))

    def _admit(self, block: bool) -> None:
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

    def _add(self, sub: Submission) -> None:
        try:
            self.llm.add_request(sub.prompt, sub.params, request_id=sub.request_id)
        except RequestError as exc:
            sub.replies.put(exc)
            return
        self._replies[sub.request_id] = sub.replies

    def _step(self) -> None:
        try:
            deltas, stats = self.llm.step_deltas()
        except Exception as exc:  # a failed step ends its requests, not the server
            self._fail_all(exc)
            return
        if self.metrics is not None:
            self.metrics.observe_step(stats)
        for delta in deltas:
            self._deliver(delta)

    def _deliver(self, delta: StreamDelta) -> None:
        replies = self._replies.get(delta.request_id)
        if replies is None:
            return
        replies.put(delta)
        if delta.output is not None:
            del self._replies[delta.request_id]
            if self.metrics is not None:
                self.metrics.observe_finished(delta.output)

    def _fail_all(self, exc: Exception) -> None:
        for rid, replies in list(self._replies.items()):
            self.llm.abort(rid)
            replies.put(RequestError(f"The engine failed ({type(exc).__name__}: {exc}); "
                                     "the request was dropped."))
        self._replies.clear()
        self.llm.step()  # applies the aborts so the blocks are freed
