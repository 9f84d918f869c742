"""Background tasks on their own QThread: generators whose yields are progress and cancel points."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from engine.config import ModelError


@dataclass(frozen=True)
class Progress:
    """A progress event from a task: a fraction in [0, 1] (or None when unknown) and a message."""

    fraction: float | None
    message: str


log = logging.getLogger(__name__)


def unexpected_message(exc: BaseException) -> str:
    """The sentence a user reads for a failure nobody foresaw: what happened, without Python's
    type name or a traceback (those go to the log)."""
    if isinstance(exc, OSError) and exc.strerror:
        detail = exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    else:
        detail = str(exc).strip() or "no details were given"
    return (f"Something went wrong: {detail.rstrip('.')}. The details are in the log; please "
            "report this.")


# A task receives a cancel flag and yields Progress; its return value is the result.
TaskFunction = Callable[[threading.Event], Generator[Progress, None, Any]]


def relay(work: Callable[[Callable[[Progress], None]], Any], name: str,
          join_on_close: bool = True) -> Generator[Progress, None, Any]:
    """Run ``work(report)`` on a helper thread and yield each Progress it reports; return its
    result, or raise what it raised, in the task's own thread.

    The one way a task turns a progress callback (the planner's search, the load generator)
    into yields, so each report is also a point where the runner can cancel (Orange's
    TaskState). ``work`` should watch the task's cancel flag itself to stop early; on cancel
    the helper is joined unless ``join_on_close`` is False (work bounded by itself)."""
    events: queue.Queue = queue.Queue()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work(events.put)
        except BaseException as exc:  # handed to the task's thread, which reports it
            box["error"] = exc
        finally:
            events.put(None)

    helper = threading.Thread(target=run, name=name, daemon=True)
    helper.start()
    finished = False
    try:
        while (event := events.get()) is not None:
            yield event
        finished = True
    finally:
        if finished or join_on_close:
            helper.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


class _TaskThread(QThread):
    progressed = Signal(object)
    succeeded = Signal(object)
    failed = Signal(str)
    cancelled = Signal()

    def __init__(self, task: TaskFunction, cancel: threading.Event) -> None:
        super().__init__()
        self._task = task
        self._cancel = cancel

    def run(self) -> None:
        try:
            result = self._drive(self._task(self._cancel))
        except ModelError as exc:
            self.failed.emit(str(exc))
            return
        except Exception as exc:  # a task's failure becomes a notification, never a crash
            log.exception("background task failed")
            self.failed.emit(unexpected_message(exc))
            return
        if self._cancel.is_set():
            self.cancelled.emit()
        else:
            self.succeeded.emit(result)

    def _drive(self, generator: Generator[Progress, None, Any]) -> Any:
        try:
            while True:
                self.progressed.emit(next(generator))
                if self._cancel.is_set():
                    generator.close()
                    return None
        except StopIteration as stop:
            return stop.value


class TaskRunner(QObject):
    """Runs one task at a time on a fresh QThread; stop() is flag, quit(), wait()."""

    progressed = Signal(object)
    succeeded = Signal(object)
    failed = Signal(str)
    cancelled = Signal()
    finished = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: _TaskThread | None = None
        self._cancel = threading.Event()

    def is_running(self) -> bool:
        """Whether a task is in progress."""
        return self._thread is not None and self._thread.isRunning()

    def start(self, task: TaskFunction) -> None:
        """Start ``task``; a task already running is stopped first."""
        self.stop()
        self._cancel = threading.Event()
        thread = _TaskThread(task, self._cancel)
        thread.progressed.connect(self.progressed)
        thread.succeeded.connect(self.succeeded)
        thread.failed.connect(self.failed)
        thread.cancelled.connect(self.cancelled)
        thread.finished.connect(self._on_finished)
        self._thread = thread
        thread.start()

    def cancel(self) -> None:
        """Ask the task to stop at its next yield; returns at once."""
        self._cancel.set()

    def stop(self) -> None:
        """Cancel the task and wait for its thread to end."""
        thread = self._thread
        if thread is None:
            return
        self._cancel.set()
        thread.quit()
        thread.wait()
        self._thread = None

    def _on_finished(self) -> None:
        # The finished thread object is kept until the next start() or stop(): dropping it
        # here, inside its own signal, would delete it while Qt is still delivering.
        self.finished.emit()
