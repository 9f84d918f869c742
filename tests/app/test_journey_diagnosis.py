"""Journey: Monitor → Diagnosis tab → Diagnose now → read the verdict's evidence and advice →
history → export CSV and JSON, on a recording of real vLLM with too small a KV cache
(benchmarks/diagnosis_vllm_kv.py) stored in the app's database as `servescope record` stores it,
its last sample a few seconds ago."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from tests.app.test_journey_servers import go_to
from tests.app.user import (
    DialogAnswerer,
    answer_file_dialog,
    button,
    click_row,
    menu_action,
    press,
    raw_errors,
)

RECORDING = Path(__file__).resolve().parents[1] / "monitor" / "diagnosis_vllm_kv.json"


def store_recording() -> int:
    """The real vLLM series written into the default database, ending 2 s ago."""
    from storage.db import open_database
    from storage.records import Sample
    from storage.writer import Writer

    series = json.loads(RECORDING.read_text())["series"]
    last = max(points[-1][0] for points in series.values())
    shift = time.time() - 2.0 - last
    db = open_database()
    writer = Writer(db).start()
    writer.submit([Sample(key, shift + ts, value) for key, points in series.items()
                   for ts, value in points])
    assert writer.close()
    db.close()
    preempted = series["vllm/preemptions_total"]
    return round(preempted[-1][1] - preempted[0][1])


def database_open(qtbot, monitor) -> None:
    """Until the window has started its panes (just after it is first shown) and the monitor's
    database is open."""
    qtbot.waitUntil(lambda: monitor.service.hub is not None, timeout=10_000)
    assert monitor.service.wait_for_database(30) and monitor.service.db is not None


def test_journey_diagnosis_names_kv_pressure_and_exports_it(make_window, qtbot, tmp_path):
    preemptions = store_recording()
    window = make_window()
    monitor = window.pane("monitor")
    view = monitor.diagnosis
    database_open(qtbot, monitor)
    go_to(qtbot, window, "Monitor")
    tab_bar = monitor.tabs.tabBar()
    qtbot.mouseClick(tab_bar, Qt.MouseButton.LeftButton, pos=tab_bar.tabRect(1).center())
    assert monitor.tabs.currentWidget() is view

    # Judge the last 5 minutes (the recording is under 2 minutes long).
    view.span_combo.setCurrentIndex(view.span_combo.findText("5 min"))
    with qtbot.waitSignal(view.diagnosed, timeout=30_000):
        qtbot.mouseClick(button(view, "Diagnose now"), Qt.MouseButton.LeftButton)
    table = view.current_table
    causes = [table.item(r, 0).text() for r in range(table.rowCount())]
    expected = f"p99 TTFT spike with KV cache full and {preemptions} preemptions"
    assert any(c.startswith(expected) for c in causes), (causes, view.summary.text())
    assert view.summary.text().startswith("vllm: ")

    # The verdict's evidence (series, window, values) and what to try.
    click_row(qtbot, table, next(i for i, c in enumerate(causes) if c.startswith(expected)))
    details = view.details.toPlainText()
    assert "max of vllm/kv_cache_usage over 300 s is 1 (limit KV_FULL = 0.9)" in details
    assert "increase of vllm/preemptions_total" in details
    assert "Try: KV-cache pressure" in details

    # Judged again through the shortcut: the same episode, still one history row per cause.
    go_to(qtbot, window, "History")
    with qtbot.waitSignal(view.diagnosed, timeout=30_000):
        press(qtbot, window, "Ctrl+Alt+D")
    assert window.rail.current_id() == "history"  # the shortcut works from any pane
    history = view.history_table
    rows = [history.item(r, 0).text() for r in range(history.rowCount())]
    assert len(rows) == len(causes) and sorted(rows) == sorted(causes)

    # Export both ways through the save dialog.
    go_to(qtbot, window, "Monitor")
    target = tmp_path / "verdicts.csv"
    answerer = DialogAnswerer(answer_file_dialog(str(target)))
    qtbot.mouseClick(button(view, "Export verdicts as CSV"), Qt.MouseButton.LeftButton)
    answerer.stop()
    with target.open(encoding="utf-8") as f:
        exported = list(csv.DictReader(f))
    assert any(r["rule"] == "kv_pressure" and r["title"].startswith(expected) for r in exported)
    target = tmp_path / "verdicts.json"
    answerer = DialogAnswerer(answer_file_dialog(str(target)))
    qtbot.mouseClick(button(view, "Export verdicts as JSON"), Qt.MouseButton.LeftButton)
    answerer.stop()
    stored = json.loads(target.read_text(encoding="utf-8"))
    kv = next(v for v in stored if v["rule"] == "kv_pressure")
    assert {e["series"] for e in kv["evidence"]} >= {"vllm/ttft_s_p99", "vllm/kv_cache_usage",
                                                    "vllm/preemptions_total"}
    assert raw_errors(window) == []


def test_diagnosis_on_an_empty_database_says_what_it_could_not_judge(make_window, qtbot):
    window = make_window()
    monitor = window.pane("monitor")
    go_to(qtbot, window, "Monitor")
    database_open(qtbot, monitor)
    view = monitor.diagnosis
    assert monitor.tabs.currentWidget() is not view
    with qtbot.waitSignal(view.diagnosed, timeout=30_000):
        menu_action(window, "Monitor", "Diagnose now").trigger()
    assert monitor.tabs.currentWidget() is view  # the menu shows what it found
    assert view.current_table.rowCount() == 0
    assert view.summary.text().startswith("No rule's conditions held over 300 s")
    assert "not judged for want of series" in view.summary.text()
    # Nothing to export: a sentence, not an empty file.
    qtbot.mouseClick(button(view, "Export verdicts as CSV"), Qt.MouseButton.LeftButton)
    assert any(n.message.startswith("No verdicts to export yet")
               for n in window.notifications.notifications())


def test_without_a_database_the_hubs_live_series_are_judged():
    """The view's task where the database could not open: the hub's ring buffers, nothing
    stored (the recording replayed into a hub as its scrapes would have filled it)."""
    from types import SimpleNamespace

    from app.panes.monitor.diagnosis import diagnose_task
    from monitor.hub import Hub
    from monitor.types import Sample

    series = json.loads(RECORDING.read_text())["series"]
    shift = time.time() - 2.0 - max(points[-1][0] for points in series.values())
    hub = Hub()
    hub._store([Sample(key, shift + ts, value) for key, points in series.items()
                for ts, value in points], [])
    task = diagnose_task(SimpleNamespace(db=None, hub=hub), 300.0)(None)
    with pytest.raises(StopIteration) as done:  # no progress yields: straight to its result
        next(task)
    result = done.value.value
    assert "kv_pressure" in {v["rule"] for v in result["verdicts"]}
    assert result["history"] == []
