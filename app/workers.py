"""Background tasks on their own QThread: generators whose yields are progress and cancel points
(their Qt-free parts, Progress and relay, are in app.tasks)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from app.tasks import Progress, TaskFunction, relay, unexpected_message
from engine.config import ModelError

__all__ = ["Progress", "TaskFunction", "TaskRunner", "relay", "unexpected_message"]
log = logging.getLogger(__name__)


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
        # Until the task's outcome reaches this thread. Not QThread.isRunning(): the thread
        # still runs for a moment after it sends its outcome, and a click answered in that
        # moment ("Diagnose now" again) was dropped as if a task were in progress.
        self._in_progress = False

    def is_running(self) -> bool:
        """Whether a task is in progress (its outcome not yet delivered)."""
        return self._in_progress

    def start(self, task: TaskFunction) -> None:
        """Start ``task``; a task already running is stopped first."""
        self.stop()
        self._cancel = threading.Event()
        thread = _TaskThread(task, self._cancel)
        thread.progressed.connect(self.progressed)
        thread.succeeded.connect(self._on_succeeded)
        thread.failed.connect(self._on_failed)
        thread.cancelled.connect(self._on_cancelled)
        thread.finished.connect(self._on_finished)
        self._thread = thread
        self._in_progress = True
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
        self._in_progress = False

    # The outcome is settled before it is passed on, so its handlers see no task in progress.
    # A thread stopped by start() or stop() may still have signals queued: they are dropped, so
    # a stale outcome never ends (or reports for) the task that replaced it.
    def _settles(self) -> bool:
        if self.sender() is not self._thread:
            return False
        self._in_progress = False
        return True

    def _on_succeeded(self, result: object) -> None:
        if self._settles():
            self.succeeded.emit(result)

    def _on_failed(self, message: str) -> None:
        if self._settles():
            self.failed.emit(message)

    def _on_cancelled(self) -> None:
        if self._settles():
            self.cancelled.emit()

    def _on_finished(self) -> None:
        if not self._settles():  # an outcome is always sent first; this is the backstop
            return
        # The finished thread object is kept until the next start() or stop(): dropping it
        # here, inside its own signal, would delete it while Qt is still delivering.
        self.finished.emit()
