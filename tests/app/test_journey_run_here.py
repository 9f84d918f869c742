"""Plan → run → measure → calibrate on this machine, as a user does it in the window: this
machine measured (`servescope plan machine`), the demo model planned on it, the chosen plan run
with "Run here", the run stored beside its prediction, the planner calibrated from it, and the
run listed in History (issue #15 item 5)."""

from __future__ import annotations

import os
import subprocess
import sys

from PySide6.QtCore import Qt

from app.panes.planner.state import FormState
from tests.app.test_journey_planner import SEARCH_MS, left_last_time, planner_window
from tests.app.user import button, raw_errors

RUN_MS = 300_000


def measure_this_machine() -> str:
    """`servescope plan machine --quick`, as the user runs it before planning here."""
    done = subprocess.run([sys.executable, "-m", "app.cli", "plan", "machine", "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    return done.stdout.split(":", 1)[0]  # "<processor name>: read ... GB/s, ..."


def test_journey_run_the_chosen_plan_here_and_calibrate_from_it(make_window, qtbot, demo_gguf):
    machine = measure_this_machine()
    left_last_time(FormState(model="SmolLM2-135M", rate=1.0, input_len=24, input_dist="fixed",
                             output_len=12, output_dist="fixed", ttft_p99_ms=120_000,
                             tpot_p99_ms=10_000, gpus=(machine,), weights=("bf16", "int8"),
                             kv=("bf16",), speculative=False, num_requests=60))
    window, pane = planner_window(make_window, qtbot)
    assert pane.outcome is not None and pane.outcome.best is not None, pane.status.text()
    plan = pane.chosen
    assert plan.deployment.gpu.name == machine and plan.deployment.gpus == 1
    pane.tabs.setCurrentWidget(pane.deploy_page)  # the Deploy tab, beside the plan's commands
    run_here = button(pane, "Run here")
    assert run_here.isVisible() and run_here.isEnabled(), run_here.toolTip()
    before = pane.calibration.name

    with qtbot.waitSignal(pane.run_here_runner.finished, timeout=RUN_MS):
        qtbot.mouseClick(run_here, Qt.MouseButton.LeftButton)
    messages = [n.message for n in window.notifications.notifications()]
    ran = [m for m in messages if m.startswith("Ran the plan here")]
    assert ran, messages
    assert "tok/s measured against" in ran[0] and "stored as run" in ran[0]
    # The stored run calibrated the planner for this machine.
    qtbot.waitUntil(lambda: pane.calibration.name != before, timeout=SEARCH_MS)
    assert machine in pane.calibration.name
    assert run_here.isEnabled()

    history = window.pane("history")
    window.rail.select("history")
    with qtbot.waitSignal(history.loaded, timeout=60_000):
        qtbot.mouseClick(button(history, "Refresh runs"), Qt.MouseButton.LeftButton)
    names = [history.runs_table.item(r, 2).text() for r in range(history.runs_table.rowCount())]
    assert any("plan run: SmolLM2-135M" in n for n in names), names
    assert not raw_errors(window)


def test_run_here_is_off_for_a_plan_elsewhere_and_says_why(make_window, qtbot):
    left_last_time(FormState(model="Llama-3.1-8B", rate=4.0, gpus=("L40S",), weights=("fp8",),
                             kv=("fp8",), speculative=False, num_requests=200))
    window, pane = planner_window(make_window, qtbot)
    run_here = button(pane, "Run here")
    assert not run_here.isEnabled()
    assert "This plan is for L40S" in run_here.toolTip()
    assert "servescope plan machine" in run_here.toolTip()
