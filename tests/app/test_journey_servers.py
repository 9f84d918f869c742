"""Journey 3, driven only through what a user touches: Servers → Add server (button, menu and
shortcut) → Test connection → live Monitor charts → Load test → History → compare → export CSV,
against a real `servescope serve` on 127.0.0.1."""

from __future__ import annotations

import time

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QDialogButtonBox

from tests.app.user import (
    DialogAnswerer,
    answer_file_dialog,
    button,
    click_row,
    menu_action,
    press,
    raw_errors,
)


@pytest.fixture(scope="module")
def engine_server(demo_gguf):
    from engine import LLM
    from engine.server import serve

    srv = serve(LLM(str(demo_gguf), device="cpu", kv_cache_tokens=1024), "127.0.0.1", 0)
    yield srv
    srv.close()


def fill_server(qtbot, name: str, url: str, price: str = ""):
    """An answer to the Add server dialog: type the fields, then press OK."""

    def answer(dialog) -> None:
        qtbot.keyClicks(dialog.name, name)
        dialog.url.selectAll()
        qtbot.keyClicks(dialog.url, url)
        if price:
            dialog.price.selectAll()
            qtbot.keyClicks(dialog.price, price)
        ok = dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok)
        qtbot.mouseClick(ok, Qt.MouseButton.LeftButton)

    return answer


def go_to(qtbot, window, title: str) -> None:
    """Click the pane's entry in the navigation rail."""
    rail = window.rail
    item = rail.findItems(title, Qt.MatchFlag.MatchExactly)[0]
    qtbot.mouseClick(rail.viewport(), Qt.MouseButton.LeftButton,
                     pos=rail.visualItemRect(item).center())
    assert window.rail.current_id() == title.lower()


def add_server_by(qtbot, window, servers, how: str, name: str, url: str) -> None:
    answerer = DialogAnswerer(fill_server(qtbot, name, url, "2.5" if how == "button" else ""))
    if how == "button":
        qtbot.mouseClick(button(servers, "Add server"), Qt.MouseButton.LeftButton)
    elif how == "menu":
        menu_action(window, "Servers", "Add server…").trigger()
    else:
        press(qtbot, window, "Ctrl+Shift+N")
    qtbot.waitUntil(lambda: name in table_names(servers), timeout=15_000)
    answerer.stop()
    assert answerer.seen == ["Add server"]


def table_names(servers) -> list[str]:
    t = servers.table
    return [t.item(r, 0).text() for r in range(t.rowCount()) if t.item(r, 0)]


def table_row(servers, name: str) -> dict[str, str]:
    from app.panes.monitor.servers import COLUMNS

    t = servers.table
    row = table_names(servers).index(name)
    return {c: t.item(row, i).text() for i, c in enumerate(COLUMNS)}


def select_server(qtbot, servers, name: str) -> None:
    click_row(qtbot, servers.table, table_names(servers).index(name))
    assert servers.selected() == name


def run_load_test(qtbot, servers, history) -> object:
    from app.panes.monitor.loadtest import LoadTestDialog

    qtbot.mouseClick(button(servers, "Load test"), Qt.MouseButton.LeftButton)
    dialog = next(w for w in QApplication.topLevelWidgets()
                  if isinstance(w, LoadTestDialog) and w.isVisible())
    qtbot.addWidget(dialog)
    for spin, text in ((dialog.requests, "4"), (dialog.input_len, "8"),
                       (dialog.output_len, "8")):
        spin.lineEdit().selectAll()
        qtbot.keyClicks(spin, text)
    assert dialog.requests.value() == 4
    with qtbot.waitSignal(history.loaded, timeout=60_000):
        qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    return dialog


def test_journey_servers_to_history(make_window, engine_server, qtbot, tmp_path):
    window = make_window()
    servers, history, monitor = (window.pane(p) for p in ("servers", "history", "monitor"))
    assert servers.service.wait_for_database(30)
    go_to(qtbot, window, "Servers")

    # Add server from its button, its menu item and its shortcut.
    add_server_by(qtbot, window, servers, "button", "local", engine_server.url)
    add_server_by(qtbot, window, servers, "menu", "via-menu", engine_server.url)
    add_server_by(qtbot, window, servers, "shortcut", "via-shortcut", engine_server.url)
    assert sorted(table_names(servers)) == ["local", "via-menu", "via-shortcut"]
    assert table_row(servers, "local")["$/hour"] == "2.5"
    for name in ("via-menu", "via-shortcut"):
        select_server(qtbot, servers, name)
        qtbot.mouseClick(button(servers, "Remove server"), Qt.MouseButton.LeftButton)
    assert table_names(servers) == ["local"]

    # Test connection: the table shows its kind and that it is up, and a banner says so.
    select_server(qtbot, servers, "local")
    with qtbot.waitSignal(servers.tester.succeeded, timeout=20_000):
        qtbot.mouseClick(button(servers, "Test connection"), Qt.MouseButton.LeftButton)
    assert table_row(servers, "local")["Kind"] == "vllm"
    assert table_row(servers, "local")["Status"] == "up"
    assert any(n.message.startswith("local is up") for n in window.notifications.notifications())

    # Live Monitor charts from it.
    go_to(qtbot, window, "Monitor")
    qtbot.waitUntil(lambda: any(k.startswith("local/") and monitor.charts["kv"].data[k][0].size
                                for k in monitor.charts["kv"].data), timeout=15_000)
    assert monitor.source_combo.findText("local") >= 0

    # Two load tests from the Servers pane; both reach History.
    go_to(qtbot, window, "Servers")
    select_server(qtbot, servers, "local")
    dialog = run_load_test(qtbot, servers, history)
    assert dialog.message.text().startswith("4 completed, 0 failed")
    assert dialog.table.item(0, 0).text() == "TTFT (ms)"
    assert float(dialog.table.item(0, 1).text()) > 0
    with qtbot.waitSignal(history.loaded, timeout=60_000):
        qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(dialog.close_button, Qt.MouseButton.LeftButton)

    go_to(qtbot, window, "History")
    runs = history.runs_table
    assert runs.rowCount() == 2
    assert [runs.item(r, 2).text() for r in range(2)] == ["local", "local"]
    assert [runs.item(r, 4).text() for r in range(2)] == ["4", "4"]

    # Compare the two: select both rows and press the button.
    click_row(qtbot, runs, 0)
    click_row(qtbot, runs, 1, Qt.KeyboardModifier.ControlModifier)
    with qtbot.waitSignal(history.compared, timeout=30_000):
        qtbot.mouseClick(button(history, "Compare selected runs"), Qt.MouseButton.LeftButton)
    compare = history.compare_table
    cells = {compare.item(r, 0).text(): [compare.item(r, c).text() for c in (1, 2, 3)]
             for r in range(compare.rowCount())}
    assert cells["Completed"] == ["4", "4", "0"]
    assert float(cells["TTFT p50 (ms)"][0]) > 0

    # Export CSV through the save dialog.
    target = tmp_path / "runs.csv"
    answerer = DialogAnswerer(answer_file_dialog(str(target)))
    qtbot.mouseClick(button(history, "Export runs as CSV"), Qt.MouseButton.LeftButton)
    answerer.stop()
    lines = target.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and lines[0].startswith("Id,Kind,Name")
    compared = (tmp_path / "runs.compare.csv").read_text(encoding="utf-8").splitlines()
    assert compared[0] == "metric,run_a,run_b,b_minus_a"
    assert "Completed,4,4,0" in compared

    assert raw_errors(window) == []


def test_recorded_minutes_show_in_the_short_windows(make_window, qtbot):
    """Samples another process recorded (`servescope record`) a minute ago show in the 1, 5
    and 15-minute windows, not only in the hour-long ones."""
    from storage.db import open_database
    from storage.records import Sample
    from storage.writer import Writer

    db = open_database(None)  # the database the window opens (the test's data folder)
    now = time.time()
    writer = Writer(db).start()
    writer.submit([Sample("recorder/kv_cache_usage", now - 100 + i, 0.25) for i in range(90)])
    assert writer.flush()
    writer.close()
    db.close()

    window = make_window()
    monitor = window.pane("monitor")
    assert monitor.service.wait_for_database(30)
    go_to(qtbot, window, "Monitor")
    chart = monitor.charts["kv"]
    for label, oldest in (("1 min", now - 61), ("5 min", now - 101), ("15 min", now - 101)):
        monitor.window_combo.setCurrentIndex(monitor.window_combo.findText(label))
        qtbot.waitUntil(lambda: len(chart.data.get("recorder/kv_cache_usage", ((), ()))[0]) > 0,
                        timeout=30_000)
        ts, values = chart.data["recorder/kv_cache_usage"]
        assert ts.min() >= oldest and set(values) == {25.0}  # the chart's unit is %
    assert monitor.source_combo.findText("recorder") >= 0


def test_why_a_server_is_down_shows_live_in_the_table(make_window, qtbot):
    """Servers added through the dialog beside hostile /metrics endpoints: the hub's own scrapes
    (no Test connection pressed) fill in each one's reason and scrape counts within seconds, and
    the healthy one stays up beside a hanging one."""
    from tests.monitor.hostile import HostileServer

    hostile = HostileServer()
    try:
        window = make_window()
        servers = window.pane("servers")
        assert servers.service.wait_for_database(30)
        go_to(qtbot, window, "Servers")
        expected = {"good": None, "hang": "timeout", "missing": "http_status",
                    "nan": "non_finite", "random": "invalid_utf8"}
        for path in expected:
            add_server_by(qtbot, window, servers, "button", path, hostile.url_for(path))

        def shown() -> bool:
            rows = {name: table_row(servers, name) for name in expected}
            return all(rows[n]["Why"].startswith(code) if code else rows[n]["Status"] == "up"
                       for n, code in expected.items())

        qtbot.waitUntil(shown, timeout=30_000)
        assert "NaN/Inf skipped" in table_row(servers, "nan")["Scrapes"]
        assert "0 failed" in table_row(servers, "good")["Scrapes"]
        assert "did not answer within" in table_row(servers, "hang")["Last error"]
        assert not raw_errors(window)
    finally:
        hostile.close()
