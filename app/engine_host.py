"""The engine on its own QThread: a worker owning the LLM and a GUI-side host talking to it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from app.panes.engine.state import (
    EngineInfo,
    LoadRequest,
    RateMeter,
    ReplyFigures,
    SamplingSettings,
    StepHistory,
    StreamBuffer,
)
from app.workers import unexpected_message
from engine.config import ModelError
from engine.sequence import RequestError

log = logging.getLogger(__name__)
FinishedListener = Callable[[list[Any]], None]


class FinishedListeners:
    """Callables given each batch of finished RequestOutputs, on the engine thread.

    Added and removed from any thread; each call is guarded so a failing listener (the monitor's)
    never ends a reply or a benchmark.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[FinishedListener] = []

    def add(self, listener: FinishedListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: FinishedListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def notify(self, outputs: list[Any]) -> None:
        with self._lock:
            listeners = list(self._listeners)  # call outside the lock: a listener may remove itself
        for listener in listeners:
            try:
                listener(outputs)
            except Exception:  # the reply matters more than its record in the monitor
                log.exception("a finished-request listener failed")


class _ReportingLLM:
    """The LLM, with generate() also handing its finished outputs to the listeners."""

    def __init__(self, llm: Any, listeners: FinishedListeners) -> None:
        self._llm = llm
        self._listeners = listeners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        outputs = self._llm.generate(*args, **kwargs)
        self._listeners.notify(list(outputs))
        return outputs


class _Epochs:
    """Cancellation by epoch: an operation whose epoch has moved on is cancelled.

    Plain ints written by the GUI thread and read by the engine thread (atomic in CPython); a
    counter rather than a flag so that a new request cannot un-cancel an older one still running.
    """

    def __init__(self) -> None:
        self.load = 0
        self.generate = 0
        self.bench = 0


class _EngineWorker(QObject):
    """Owns the engine.LLM; every slot runs on the engine thread."""

    # One queued signal to the host: (name of the host signal to emit, its payload). Receivers
    # must live on the GUI thread; a plain callable connected here would run on this thread.
    event = Signal(str, object)

    def __init__(self, epochs: _Epochs, buffer: StreamBuffer, meter: RateMeter,
                 finished: FinishedListeners, history: StepHistory,
                 canaries: FinishedListeners | None = None) -> None:
        super().__init__()
        self._finished = finished
        self._canaries = canaries if canaries is not None else FinishedListeners()
        self._history = history
        self._epochs = epochs
        self._buffer = buffer
        self._meter = meter
        self._llm: Any = None
        self._loaded_request: LoadRequest | None = None
        self.stats: Any = None

    def _emit(self, name: str, *payload: Any) -> None:
        self.event.emit(name, payload)

    @Slot(object, int)
    def load(self, request: LoadRequest, epoch: int) -> None:
        self._release_llm()
        started = time.perf_counter()
        self._emit("load_progress", 0.05, "Starting PyTorch")
        try:
            from engine import LLM, LoadCancelled

            if self._epochs.load != epoch:
                self._emit("load_cancelled")
                return
            message = f"Loading {request.model} onto {request.device}"

            def progress(fraction: float) -> None:
                # Called between tensors: a cancel stops the load there, not after it.
                if self._epochs.load != epoch:
                    raise LoadCancelled("The load was cancelled.")
                self._emit("load_progress", 0.3 + 0.6 * fraction, message)

            progress(0.0)
            llm = LLM(request.engine_config(), progress=progress)
        except LoadCancelled:
            self._emit("load_cancelled")
            return
        except Exception as exc:  # every load failure is reported, the app stays usable
            self._emit("load_failed", describe_load_error(request, exc))
            return
        if self._epochs.load != epoch:
            llm.close()
            self._emit("load_cancelled")
            return
        self._llm = llm
        self._loaded_request = request
        self.stats = None
        self._history.reset()
        llm.step_observers.append(self._history.record)  # every step, chat or benchmark
        self._emit("loaded", EngineInfo.from_llm(llm, time.perf_counter() - started))

    def spec_summary(self) -> dict | None:
        # Read from the GUI thread: the summary copies plain counters, so no lock is needed.
        llm = self._llm
        spec = None if llm is None else llm.spec
        return None if spec is None else spec.summary()

    @Slot()
    def unload(self) -> None:
        self._release_llm()

    @Slot(object, object, int)
    def generate(self, messages: list[dict[str, str]], sampling: SamplingSettings,
                 epoch: int) -> None:
        if self._llm is None:
            self._emit("reply_failed", "No model is loaded: load one in the Engine pane first.")
            return
        try:
            from engine import SamplingParams

            params = SamplingParams(**sampling.as_kwargs())
            output = self._stream(messages, params, epoch)
        except Exception as exc:  # a generation error ends the reply, not the app
            log.exception("generation failed")
            self._emit("reply_failed", f"Generation failed. {unexpected_message(exc)}")
            return
        self._emit("reply_finished", None if output is None else ReplyFigures.from_output(output))

    def _stream(self, messages: list[dict[str, str]], params: Any, epoch: int) -> Any:
        stream = self._llm.stream(messages, params)
        aborted = False
        try:
            for delta in stream:
                self._buffer.push(delta.text, delta.drafted)
                self._meter.add(len(delta.token_ids))
                self.stats = self._llm.last_stats
                if delta.output is not None:
                    self._finished.notify([delta.output])
                    return delta.output
                if self._epochs.generate != epoch and not aborted:
                    # Aborting (rather than closing) still yields the final output and its figures.
                    self._llm.abort(delta.request_id)
                    aborted = True
        finally:
            stream.close()
        return None

    @Slot()
    def score_canary(self) -> None:
        """The quality canary on the loaded model: the bundled held-out text's perplexity from
        the engine's own logits (one prefill), as a server's canary scores it over HTTP."""
        if self._llm is None:
            self._emit("canary_failed", "No model is loaded: load one before scoring the "
                                        "quality canary.")
            return
        try:
            score = canary_score(self._llm)
        except RequestError as exc:
            self._emit("canary_failed", f"The quality canary could not be scored: {exc}")
            return
        except Exception as exc:  # reported in the pane; the model stays loaded
            log.exception("canary scoring failed")
            self._emit("canary_failed", f"The quality canary failed. {unexpected_message(exc)}")
            return
        self.stats = self._llm.last_stats
        self._canaries.notify([(self._llm.model_name, score)])
        self._emit("canary_scored", score)

    @Slot(bool, int)
    def benchmark(self, quick: bool, epoch: int) -> None:
        if self._llm is None:
            self._emit("bench_failed", "No model is loaded: load one before running the benchmark.")
            return
        try:
            result = self._run_benchmark(quick, epoch)
        except Exception as exc:  # reported in the pane; the model stays loaded
            log.exception("benchmark failed")
            self._emit("bench_failed", f"Benchmark failed. {unexpected_message(exc)}")
            return
        if result is None:
            self._emit("bench_cancelled")
        else:
            self._emit("bench_finished", result)

    def _run_benchmark(self, quick: bool, epoch: int) -> dict | None:
        from engine.bench import iter_benchmark, save_result

        # The benchmark's requests reach the monitor too, through generate().
        events = iter_benchmark(_ReportingLLM(self._llm, self._finished), quick=quick)
        result = None
        try:
            for event in events:
                self.stats = self._llm.last_stats
                self._emit("bench_progress", float(event.fraction), str(event.message))
                result = event.result if event.result is not None else result
                if self._epochs.bench != epoch:
                    return None
        finally:
            events.close()
        if result is None:
            raise RuntimeError("the benchmark ended without a result")
        llm = self._llm
        result = {"model": llm.model_name, "device": llm.device, "dtype": llm.dtype, **result}
        # What the planner and History need to know the figures by: weights, KV, spec, policy.
        if self._loaded_request is not None:
            result["configuration"] = self._loaded_request.configuration()
        save_result(result)
        return result

    @Slot()
    def release(self) -> None:
        """Free the model; runs on the engine thread via a direct QThread.finished link."""
        self._release_llm()

    def _release_llm(self) -> None:
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        self.stats = None
        self._history.reset()
        llm.close()
        self._emit("unloaded")


def canary_score(llm: Any) -> Any:
    """The held-out text scored by the engine itself (monitor.canary.CanaryScore)."""
    from engine.logprobs import prompt_logprobs
    from monitor.canary import heldout_text, summarise

    started = time.perf_counter()
    ids = llm.tokenizer.encode(heldout_text())
    values = [None if v is None else v.logprob
              for v in prompt_logprobs(llm.prompt_logits(ids), ids, 0)]
    return summarise(values, time.perf_counter() - started, "engine",
                     f"the embedded engine ({llm.model_name})")


def describe_load_error(request: LoadRequest, exc: BaseException) -> str:
    """One sentence for a failed load that names the input and what to do."""
    if isinstance(exc, ModelError | RequestError):
        return str(exc)  # already one sentence naming the input (a bad KV policy or budget)
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return (f"Not enough memory on {request.device} to load {request.model}: lower the "
                "context or concurrency, pick a smaller dtype, or choose another device.")
    if isinstance(exc, FileNotFoundError):
        return f"Model not found: {request.model}. Choose an existing GGUF file or model folder."
    return f"Loading {request.model} failed. {unexpected_message(exc)}"


_TERMINAL_EVENTS = frozenset({"loaded", "load_failed", "load_cancelled", "reply_finished",
                              "reply_failed", "bench_finished", "bench_failed", "bench_cancelled",
                              "canary_scored", "canary_failed"})


class EngineHost(QObject):
    """GUI-side handle on the engine thread: requests go in queued, results come back as signals."""

    state_changed = Signal(str)
    load_progress = Signal(float, str)
    loaded = Signal(object)
    load_failed = Signal(str)
    load_cancelled = Signal()
    unloaded = Signal()
    reply_finished = Signal(object)
    reply_failed = Signal(str)
    bench_progress = Signal(float, str)
    bench_finished = Signal(object)
    bench_failed = Signal(str)
    bench_cancelled = Signal()
    canary_scored = Signal(object)  # a monitor.canary.CanaryScore
    canary_failed = Signal(str)
    _load_requested = Signal(object, int)
    _canary_requested = Signal()
    _unload_requested = Signal()
    _generate_requested = Signal(object, object, int)
    _bench_requested = Signal(bool, int)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.buffer = StreamBuffer()
        self.meter = RateMeter()
        self.info: EngineInfo | None = None
        self.state = "no model"
        self._epochs = _Epochs()
        self._pending = 0
        # Listeners of finished requests (the monitor's engine source); called on the engine thread.
        self.finished = FinishedListeners()
        # Listeners of quality canary scores, given [(model name, CanaryScore)] on the engine
        # thread (the monitor's engine source charts and judges them).
        self.canaries = FinishedListeners()
        # KV blocks used, tokens evicted and prefix hit rate per engine step, for the live chart.
        self.history = StepHistory()
        self._thread = QThread()
        self._thread.setObjectName("servescope-engine")
        self.worker = _EngineWorker(self._epochs, self.buffer, self.meter, self.finished,
                                    self.history, self.canaries)
        self.worker.moveToThread(self._thread)
        self._thread.finished.connect(self.worker.release, Qt.ConnectionType.DirectConnection)
        self._connect_worker()
        self._thread.start()

    def _connect_worker(self) -> None:
        w = self.worker
        self._load_requested.connect(w.load)
        self._unload_requested.connect(w.unload)
        self._generate_requested.connect(w.generate)
        self._bench_requested.connect(w.benchmark)
        self._canary_requested.connect(w.score_canary)
        w.event.connect(self._on_event)

    # ---- requests (GUI thread)
    def load(self, request: LoadRequest) -> None:
        """Load ``request`` in the background, replacing any model loaded now."""
        self._epochs.load += 1
        self._set_state("loading")
        self._pending += 1
        self._load_requested.emit(request, self._epochs.load)

    def cancel_load(self) -> None:
        """Cancel the load in progress; load_cancelled follows once the engine thread notices."""
        self._epochs.load += 1
        if self.state == "loading":
            self._set_state("cancelling")

    def unload(self) -> None:
        """Free the model and its KV cache."""
        self._unload_requested.emit()

    def generate(self, messages: list[dict[str, str]], sampling: SamplingSettings) -> None:
        """Stream a reply to ``messages``: text arrives in ``buffer``, figures in reply_finished."""
        self._epochs.generate += 1
        self.buffer.drain()
        self._set_state("generating")
        self._pending += 1
        self._generate_requested.emit(messages, sampling, self._epochs.generate)

    def stop_generation(self) -> None:
        """Stop the reply streaming now; reply_finished follows with what was generated."""
        self._epochs.generate += 1

    def benchmark(self, quick: bool = False) -> None:
        """Run the engine benchmark in the background."""
        self._epochs.bench += 1
        self._set_state("benchmarking")
        self._pending += 1
        self._bench_requested.emit(quick, self._epochs.bench)

    def cancel_benchmark(self) -> None:
        """Stop the benchmark at its next progress event."""
        self._epochs.bench += 1

    def score_canary(self) -> None:
        """Score the quality canary on the loaded model in the background: canary_scored (or
        canary_failed) follows, and the monitor's engine source charts it."""
        self._set_state("scoring")
        self._pending += 1
        self._canary_requested.emit()

    def is_running(self) -> bool:
        """Whether the engine thread is running (it stops only in shutdown)."""
        return self._thread.isRunning()

    def stats(self) -> Any:
        """The engine's latest StepStats, or None before the first step."""
        return self.worker.stats

    def spec_summary(self) -> dict | None:
        """Speculative-decoding counters of the loaded engine, or None when it is off."""
        return self.worker.spec_summary()

    def shutdown(self) -> None:
        """Cancel everything, then stop the engine thread: flag, quit(), wait()."""
        self.cancel_load()
        self.stop_generation()
        self.cancel_benchmark()
        self._thread.quit()
        self._thread.wait()

    # ---- results (GUI thread)
    def _on_event(self, name: str, payload: tuple) -> None:
        if name == "loaded":
            self.info = payload[0]
        elif name == "unloaded":
            self.info = None
        if name in _TERMINAL_EVENTS:
            self._pending = max(0, self._pending - 1)
        # Requests queue on the engine thread, so the state settles only when the last one ends;
        # it settles before the event goes out, so receivers see the state that follows it.
        if self._pending == 0 and name != "load_progress" and name != "bench_progress":
            self._set_state("ready" if self.info is not None else "no model")
        getattr(self, name).emit(*payload)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)
