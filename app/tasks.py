"""Background work without Qt: progress events, a task's shape, and `relay`, the one helper
turning a progress callback into a task's yields (each a cancel point). app.workers runs such
tasks on a QThread; this module imports no PySide6 (an import-linter contract keeps it so), so
the Qt-free models and the command line can use it too."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """A progress event from a task: a fraction in [0, 1] (or None when unknown) and a message."""

    fraction: float | None
    message: str


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
