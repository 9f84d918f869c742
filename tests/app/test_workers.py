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


def test_a_task_is_over_when_its_outcome_arrives_though_its_thread_lingers(qtbot, monkeypatch):
    """A click answered between a task's outcome and its thread's exit (the Diagnosis tab's
    "Diagnose now" pressed again right after a verdict) starts the next task, never dropped as
    if one were still in progress."""
    from app import workers

    run = workers._TaskThread.run

    def linger(self):
        run(self)
        threading.Event().wait(0.5)  # the thread still runs after sending its outcome

    monkeypatch.setattr(workers._TaskThread, "run", linger)

    def task(cancel):
        return "verdict"
        yield  # a task is a generator

    runner = TaskRunner()
    seen = []
    runner.succeeded.connect(lambda result: seen.append((result, runner.is_running())))
    with qtbot.waitSignal(runner.succeeded, timeout=5000):
        runner.start(task)
    assert seen == [("verdict", False)]
    with qtbot.waitSignal(runner.succeeded, timeout=5000):
        runner.start(task)  # again at once: the first thread has not exited yet
    assert seen == [("verdict", False)] * 2
    runner.stop()


def test_a_replaced_tasks_outcome_is_dropped(qtbot):
    """start() while a task runs stops it; what the stopped task still sends (its cancellation)
    neither reaches the runner's listeners nor ends the task that replaced it."""
    first_running, release = threading.Event(), threading.Event()

    def first(cancel):
        first_running.set()
        cancel.wait(5)
        return "stale"
        yield

    def second(cancel):
        release.wait(5)
        return "fresh"
        yield

    runner = TaskRunner()
    outcomes = []
    runner.succeeded.connect(outcomes.append)
    runner.cancelled.connect(lambda: outcomes.append("cancelled"))
    runner.start(first)
    assert first_running.wait(5)
    runner.start(second)  # stops the first (its cancellation is queued) and starts the second
    qtbot.wait(200)  # the first's queued signals are delivered
    assert outcomes == [] and runner.is_running()
    with qtbot.waitSignal(runner.succeeded, timeout=5000):
        release.set()
    assert outcomes == ["fresh"] and not runner.is_running()
    runner.stop()
