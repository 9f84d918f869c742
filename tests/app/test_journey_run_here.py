"""Plan → run → measure → calibrate on this machine, as a user does it in the window: this
machine measured (`servescope plan machine`), the demo model planned on it, the chosen plan run
with "Run here", the run stored beside its prediction, the planner calibrated from it, and the
run listed in History (issue #15 item 5)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from PySide6.QtCore import Qt

from app.panes.planner.state import FormState
from tests.app.test_journey_engine import choose
from tests.app.test_journey_planner import SEARCH_MS, left_last_time, planner_window
from tests.app.user import DialogAnswerer, answer_file_dialog, button, menu_action, raw_errors

RUN_MS = 300_000


def measure_this_machine() -> str:
    """`servescope plan machine --quick`, as the user runs it before planning here."""
    done = subprocess.run([sys.executable, "-m", "app.cli", "plan", "machine", "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    return done.stdout.split(":", 1)[0]  # "<processor name>: read ... GB/s, ..."


def test_journey_run_the_chosen_plan_here_and_calibrate_from_it(make_window, qtbot, demo_gguf,
                                                                tmp_path):
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
    # The embedded server: tests/vllm/test_plan_run_vllm.py runs a plan on real vLLM.
    choose(pane.run_here_server, "servescope")
    before = pane.calibration.name

    with qtbot.waitSignal(pane.run_here_runner.finished, timeout=RUN_MS):
        qtbot.mouseClick(run_here, Qt.MouseButton.LeftButton)
    messages = [n.message for n in window.notifications.notifications()]
    ran = [m for m in messages if m.startswith("Ran the plan here")]
    assert ran, messages
    assert "tok/s measured against" in ran[0] and "stored as run" in ran[0]
    assert ran[0].endswith("(served by servescope).")
    run_id = int(re.search(r"stored as run (\d+)", ran[0]).group(1))
    measured_tok_s, predicted_tok_s = (float(x) for x in re.match(
        r"Ran the plan here: ([\d.]+) tok/s measured against ([\d.]+) predicted", ran[0]).groups())
    # The stored run calibrated the planner for this machine.
    qtbot.waitUntil(lambda: pane.calibration.name != before, timeout=SEARCH_MS)
    assert machine in pane.calibration.name
    assert run_here.isEnabled()

    # The Validation tab lists the run beside its prediction, and the report carries the table.
    tabs = pane.tabs
    qtbot.mouseClick(tabs.tabBar(), Qt.MouseButton.LeftButton,
                     pos=tabs.tabBar().tabRect(tabs.indexOf(pane.validation_page)).center())
    assert tabs.currentWidget() is pane.validation_page
    table = pane.validation_table
    rows = {table.item(r, 0).text(): r for r in range(table.rowCount())}
    row = next(r for text, r in rows.items() if text.startswith(f"{run_id}: plan run"))
    headers = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]
    cell = table.item(row, headers.index("throughput tok/s")).text()  # "pred / meas (err%)"
    predicted, measured = (float(x) for x in re.match(r"([\d.e+]+) / ([\d.e+]+)", cell).groups())
    assert predicted == pytest.approx(predicted_tok_s, abs=0.06 + 0.005 * predicted_tok_s)
    assert measured == pytest.approx(measured_tok_s, abs=0.06 + 0.005 * measured_tok_s)
    error = abs(predicted - measured) / measured * 100
    assert f"({error:.0f}%)" in cell or abs(
        float(re.search(r"\((\d+)%\)", cell).group(1)) - error) <= 1
    assert "concurrency" in table.item(row, 1).text() or "req/s" in table.item(row, 1).text()
    assert table.item(table.rowCount() - 1, 0).text() == "median absolute error"
    assert "Against published runs" in pane.validation_note.text()

    report = tmp_path / "plan.html"
    answerer = DialogAnswerer(answer_file_dialog(str(report)))
    menu_action(window, "Planner", "Export report…").trigger()
    answerer.stop()
    text = report.read_text(encoding="utf-8")
    assert "How far to trust these figures" in text and "Against runs made here" in text
    assert f"<td>{run_id}: plan run" in text and cell in text

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
