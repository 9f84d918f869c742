"""Planner journeys driven as a user: an infeasible search clears the old plan everywhere (5);
search → Deploy copy and save → report → scenarios → restart (4)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app.panes.planner.state import FORM_FILE, FormState, plan_label
from tests.app.user import DialogAnswerer, answer_file_dialog, button, menu_action, raw_errors

SEARCH_MS = 60_000
SMALL = FormState(model="Llama-3.1-8B", rate=4.0, gpus=("L4", "L40S"), weights=("fp8", "int4"),
                  kv=("fp8",), speculative=False, num_requests=300)


def left_last_time(form: FormState) -> None:
    """The form as the user left it in an earlier session (the pane restores it at start)."""
    folder = Path(os.environ["SERVESCOPE_CONFIG_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FORM_FILE).write_text(json.dumps(form.to_json()), encoding="utf-8")


def type_number(qtbot, spin, text: str) -> None:
    """Select the field's number, type another and press Enter, as a user does."""
    spin.setFocus()
    spin.lineEdit().selectAll()
    qtbot.keyClicks(spin, text)
    qtbot.keyClick(spin, Qt.Key.Key_Return)


def searched(qtbot, pane, change) -> None:
    """Make ``change`` (an edit of the form) and wait for the search it starts to end."""
    with qtbot.waitSignal(pane.runner.finished, timeout=SEARCH_MS):
        change()
    qtbot.waitUntil(lambda: not pane.runner.is_running() and not pane._pending,
                    timeout=SEARCH_MS)


def planner_window(make_window, qtbot):
    window = make_window()
    pane = window.pane("planner")
    window.rail.select("planner")
    qtbot.waitUntil(lambda: pane.outcome is not None, timeout=SEARCH_MS)  # the start-up search
    qtbot.waitUntil(lambda: not pane.runner.is_running(), timeout=SEARCH_MS)
    # The thread stops before its queued `finished` reaches the pane, which then hides the
    # progress bar: a finished search leaves no blank bar behind, a moment later.
    qtbot.waitUntil(pane.progress.isHidden, timeout=5_000)
    return window, pane


def test_journey_infeasible_search_clears_the_plan_everywhere(make_window, qtbot, tmp_path):
    left_last_time(SMALL)
    window, pane = planner_window(make_window, qtbot)
    best = plan_label(pane.outcome.best)
    assert best in pane.recommendation.text() and "vllm serve" in pane.deploy.toPlainText()

    # A TTFT objective no GPU can meet: nothing of the old plan may stay on screen.
    searched(qtbot, pane, lambda: type_number(qtbot, pane.form.ttft, "1"))
    assert pane.outcome is None
    assert pane.table.model().rowCount() == 0
    assert best not in pane.recommendation.text()
    assert pane.deploy.toPlainText().strip() == "" or "No plan" in pane.deploy.toPlainText()
    banner = pane.plan_banner
    assert banner.isVisible()
    assert "TTFT" in banner.text() and "SLO 1 ms" in banner.text()  # the constraint that binds
    assert "No plan" in pane.status.text()
    # Export report now writes nothing (it used to write the old plan).
    target = tmp_path / "report.html"
    answerer = DialogAnswerer(answer_file_dialog(str(target)))
    qtbot.mouseClick(button(pane, "Export report…"), Qt.MouseButton.LeftButton)
    answerer.stop()
    assert not target.exists() and answerer.seen == []
    assert any("feasible" in n.message for n in window.notifications.notifications())

    # A budget too small binds next, and the banner says so.
    searched(qtbot, pane, lambda: type_number(qtbot, pane.form.ttft, "2000"))
    assert not banner.isVisible()
    searched(qtbot, pane, lambda: type_number(qtbot, pane.form.budget, "0.01"))
    assert banner.isVisible() and "budget" in banner.text()

    # The next successful search clears the banner and shows a plan again.
    searched(qtbot, pane, lambda: type_number(qtbot, pane.form.budget, "0"))
    assert not banner.isVisible()
    assert pane.outcome is not None and plan_label(pane.outcome.best) in pane.recommendation.text()
    assert "vllm serve" in pane.deploy.toPlainText()
    assert raw_errors(window) == []


def test_costs_name_peak_and_day_average_the_same_everywhere(make_window, qtbot, tmp_path):
    left_last_time(SMALL)  # business-hours profile with autoscaling: peak and average differ
    window, pane = planner_window(make_window, qtbot)
    qtbot.waitUntil(lambda: "at peak" in pane.what_if.verdict.text(), timeout=SEARCH_MS)
    from app.panes.planner.state import plan_costs

    costs = plan_costs(pane.outcome.best, pane.outcome.form)
    assert costs.peak_per_hour > costs.average_per_hour  # the profile's quiet hours are cheaper
    peak, average = f"${costs.peak_per_hour:.2f}/hour at peak", \
        f"${costs.average_per_hour:.2f}/hour averaged over the day"
    for text in (pane.recommendation.text(), pane.what_if.verdict.text()):
        assert peak in text, text
    assert average in pane.recommendation.text()
    html_path, _pdf = pane.export_report(tmp_path / "plan.html")
    report = html_path.read_text(encoding="utf-8")
    assert peak in report and average in report


def test_journey_deploy_report_scenarios_and_restart(make_window, qtbot, tmp_path):
    left_last_time(SMALL)
    window, pane = planner_window(make_window, qtbot)
    deploy_text = pane.deploy.toPlainText()
    assert "vllm serve" in deploy_text
    pane.tabs.setCurrentIndex(pane.tabs.indexOf(pane.deploy_page))

    # Copy and save from the Deploy tab.
    QApplication.clipboard().clear()
    qtbot.mouseClick(button(pane, "Copy"), Qt.MouseButton.LeftButton)
    assert QApplication.clipboard().text() == deploy_text
    script = tmp_path / "deploy.sh"
    answerer = DialogAnswerer(answer_file_dialog(str(script)))
    qtbot.mouseClick(button(pane, "Save…"), Qt.MouseButton.LeftButton)
    answerer.stop()
    assert answerer.seen == ["Save the deploy commands"]
    assert "vllm serve" in script.read_text(encoding="utf-8")
    assert "kind: Deployment" in script.with_suffix(".yaml").read_text(encoding="utf-8")

    # Export report through its menu action and the save dialog: HTML and PDF.
    report = tmp_path / "plan.html"
    answerer = DialogAnswerer(answer_file_dialog(str(report)))
    menu_action(window, "Planner", "Export report…").trigger()
    answerer.stop()
    assert answerer.seen == ["Export the planner report"]
    assert plan_label(pane.outcome.best) in report.read_text(encoding="utf-8")
    assert report.with_suffix(".pdf").read_bytes().startswith(b"%PDF")

    # Keep two scenarios; they show side by side.
    qtbot.mouseClick(button(pane, "Keep as scenario"), Qt.MouseButton.LeftButton)
    searched(qtbot, pane, lambda: type_number(qtbot, pane.form.rate, "8"))
    qtbot.mouseClick(button(pane, "Keep as scenario"), Qt.MouseButton.LeftButton)
    table = pane.scenario_table
    names = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]
    assert names == ["Llama-3.1-8B @ 4 req/s", "Llama-3.1-8B @ 8 req/s"]

    # Presentation mode through its shortcut's action, then back.
    menu_action(window, "Planner", "Presentation mode").trigger()
    assert pane.form_scroll.isHidden()
    menu_action(window, "Planner", "Presentation mode").trigger()
    assert not pane.form_scroll.isHidden()

    # Restart: the kept scenarios are still there, without pressing "Save scenarios".
    window.close()
    window2, pane2 = planner_window(make_window, qtbot)
    table2 = pane2.scenario_table
    assert [table2.horizontalHeaderItem(c).text() for c in range(table2.columnCount())] == names
    assert raw_errors(window2) == []
    assert pane2.form.state().rate == 8.0 and pane2.form.state().model == SMALL.model


def test_calibrate_here_is_disabled_with_its_reason_without_a_gpu(make_window, qtbot):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: Calibrate here runs")
    left_last_time(SMALL)
    window, pane = planner_window(make_window, qtbot)
    qtbot.waitUntil(lambda: not pane.workstation_button.isEnabled(), timeout=30_000)
    assert "needs a CUDA GPU" in pane.workstation_button.toolTip()
    # Its shortcut's action says why instead of benchmarking for 40 s to no use.
    menu_action(window, "Planner", "Calibrate from this workstation").trigger()
    assert not pane.bench_runner.is_running()
    messages = [n.message for n in window.notifications.notifications()]
    assert sum("needs a CUDA GPU" in m for m in messages) == 1


def test_the_pdf_report_fits_its_pages_and_wraps_commands_between_flags(qtbot, tmp_path):
    from app.panes.planner.figures import all_charts
    from app.panes.planner.pane import PlannerPane
    from app.panes.planner.report_writer import pdf_document

    pane = PlannerPane(form_folder=tmp_path)
    qtbot.addWidget(pane)
    pane.form.set_state(replace(SMALL, speculative=True))  # the longest vLLM command
    with qtbot.waitSignal(pane.outcome_ready, timeout=SEARCH_MS):
        pane.recompute()
    o = pane.outcome
    document = pdf_document(o, all_charts(o.result, o.best, o.detail, o.form))
    width = document.pageSize().width()
    assert document.idealWidth() <= width  # charts, tables and commands within the margins
    block, commands = document.begin(), 0
    while block.isValid():
        layout, text = block.layout(), block.text()
        if "--" in text:  # a command or manifest: a wrapped line never ends inside a flag
            commands += 1
            for i in range(layout.lineCount() - 1):  # every line but a paragraph's last
                end = layout.lineAt(i).textStart() + layout.lineAt(i).textLength()
                if text[end - 1].isspace():
                    continue
                # Only a value longer than a line (a JSON config) may break inside itself.
                word = text[:end].split()[-1].lstrip('"\'[')
                assert not word.startswith("--"), text[max(0, end - 20):end + 20]
        block = block.next()
    assert commands >= 3
    plain = document.toPlainText()
    assert "--speculative-config" in plain and "--max-num-batched-tokens" in plain
    # The rewrapped manifests and commands mean what the one-line ones meant.
    import shlex

    import yaml

    from app.panes.planner.report import command_lines, manifest_lines
    from planner.export import kubernetes_yaml, vllm_command

    raw = kubernetes_yaml(o.best)
    assert list(yaml.safe_load_all(manifest_lines(raw))) == list(yaml.safe_load_all(raw))
    assert manifest_lines(raw) != raw
    wrapped = command_lines(vllm_command(o.best))
    assert shlex.split(wrapped.replace("\\\n", "")) == shlex.split(vllm_command(o.best))
    written = pane.export_report(tmp_path / "plan.html")
    assert written[1].read_bytes().startswith(b"%PDF")
