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
