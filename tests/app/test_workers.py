"""The one helper turning a progress callback into a task's yields (relay)."""

from __future__ import annotations

import threading

import pytest

from app.workers import Progress, TaskRunner, relay


def _drain(generator):
    events = []
    try:
        while True:
            events.append(next(generator))
    except StopIteration as stop:
        return events, stop.value


def test_relay_yields_each_report_and_returns_the_result():
    def work(report):
        for i in range(3):
            report(Progress(i / 3, f"step {i}"))
        return "done"

    events, result = _drain(relay(work, "test-relay"))
    assert [e.message for e in events] == ["step 0", "step 1", "step 2"] and result == "done"


def test_relay_raises_the_work_s_error_in_the_task_thread():
    def work(report):
        report(Progress(None, "about to fail"))
        raise ValueError("the workload has no requests")

    with pytest.raises(ValueError, match="no requests"):
        _drain(relay(work, "test-relay"))


def test_a_cancelled_relay_stops_at_a_report_and_the_runner_says_cancelled(qtbot):
    started, stop = threading.Event(), threading.Event()

    def task(cancel):
        def work(report):
            while not cancel.is_set():
                report(Progress(None, "working"))
                started.set()
                cancel.wait(0.01)
            stop.set()
            return "stopped"

        return (yield from relay(work, "test-relay"))

    runner = TaskRunner()
    runner.start(task)
    assert started.wait(5)
    with qtbot.waitSignal(runner.cancelled, timeout=5000):
        runner.cancel()
    runner.stop()
    assert stop.is_set()  # the helper was joined: nothing keeps running behind the runner
