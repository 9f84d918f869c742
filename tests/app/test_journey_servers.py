"""Journey 3, driven only through what a user touches: Servers → Add server (button, menu and
shortcut) → Test connection → live Monitor charts → Load test → History → compare → export CSV,
against a real `servescope serve` on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
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
    shown_precision,
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
    assert table_row(servers, "local")["Kind"] == "servescope"
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

    # The Monitor: each p99 TTFT line drawn with the histogram bucket it lies in (a band), and
    # the requests finished per second by their reason.
    go_to(qtbot, window, "Monitor")
    ttft, events = monitor.charts["ttft"], monitor.charts["events"]
    qtbot.waitUntil(lambda: "local/ttft_s_p99" in ttft.bands, timeout=15_000)
    band_ts, lo, hi = ttft.bands["local/ttft_s_p99"]
    line_ts, line = ttft.data["local/ttft_s_p99"]
    at = np.isin(line_ts, band_ts)
    assert at.any() and np.all((lo <= line[at] + 1e-9) & (line[at] <= hi + 1e-9))
    qtbot.waitUntil(lambda: any(k.startswith("local/requests_finished_reason_per_s[")
                                for k in events.data), timeout=15_000)

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

    # One run beside the server's own estimates for its minutes (the hub stored them).
    # (Pressed again while the server's next scrape is not stored yet, as a user would.)
    click_row(qtbot, runs, 0)
    for _ in range(30):
        with qtbot.waitSignal(history.estimated, timeout=1_000, raising=False) as blocker:
            qtbot.mouseClick(button(history, "Client vs server estimates"),
                             Qt.MouseButton.LeftButton)
        if blocker.signal_triggered:
            break
    assert history.estimates, "no server estimates after 30 s"
    assert compare.horizontalHeaderItem(0).text() == f"Run {history.runs[0]['id']} vs local"
    rows = {compare.item(r, 0).text(): [compare.item(r, c).text() for c in range(1, 5)]
            for r in range(compare.rowCount())}
    exact, estimate, bucket, gap = rows["TTFT p99 (ms)"]
    assert exact == runs.item(0, 7).text()  # the runs table's exact TTFT p99
    lo, _, hi = bucket.removesuffix(" ms").partition("–")
    assert float(lo) <= float(estimate) <= float(hi)  # the estimate lies in its bucket
    # The cells show 4 significant digits; the gap is of the unrounded values.
    assert float(gap) == pytest.approx(float(estimate) - float(exact),
                                       abs=shown_precision(estimate, exact))

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


def test_journey_terminal_record_and_loadtest_show_in_the_window(make_window, engine_server,
                                                                  qtbot):
    """Journey 6: `servescope record` and `servescope loadtest` run as commands in a terminal
    (real subprocesses; the load test names no --db, so it goes to the default database), then
    the window on that database shows the run in History and the recorded minutes in the
    Monitor's 1, 5 and 15-minute windows."""
    from storage.db import default_url

    cli = [sys.executable, "-m", "app.cli"]
    url = engine_server.url
    recorder = subprocess.Popen(cli + ["record", "--db", default_url(), "--server",
                                       f"terminal={url}", "--duration", "8", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "terminal is up" in recorder.stderr.readline()  # scraping before the load starts
        load = subprocess.run(cli + ["loadtest", "--url", url, "--requests", "4",
                                     "--concurrency", "2", "--input-len", "8",
                                     "--output-len", "8"],
                              capture_output=True, text=True, timeout=180)
        out, err = recorder.communicate(timeout=60)
    finally:
        recorder.kill()
    assert load.returncode == 0, load.stderr
    assert f"stored as run 1 in {default_url()}" in load.stdout
    assert recorder.returncode == 0, err
    recorded = json.loads(out)
    assert recorded["sources"] == {"terminal": "up"} and recorded["samples"] > 0

    window = make_window()
    history, monitor = window.pane("history"), window.pane("monitor")
    assert monitor.service.wait_for_database(30)
    go_to(qtbot, window, "History")
    qtbot.waitUntil(lambda: history.runs_table.rowCount() == 1, timeout=30_000)
    row = [history.runs_table.item(0, i).text() for i in range(history.runs_table.columnCount())]
    assert row[1:3] == ["loadtest", url] and row[4:6] == ["4", "0"]

    go_to(qtbot, window, "Monitor")
    queue, ttft = monitor.charts["queue"], monitor.charts["ttft"]

    def points(chart, key: str) -> int:
        return len(chart.data.get(key, ((), ()))[0])

    for label in ("1 min", "5 min", "15 min"):
        monitor.window_combo.setCurrentIndex(monitor.window_combo.findText(label))
        # The recorded minutes (a gauge sampled every second), and the TTFT the recorder
        # estimated from the server's histogram while the load test ran.
        qtbot.waitUntil(lambda: points(queue, "terminal/requests_running") > 3
                        and points(ttft, "terminal/ttft_s_p99") > 0, timeout=30_000)
    assert monitor.source_combo.findText("terminal") >= 0
    assert raw_errors(window) == []


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


def test_journey_a_quality_canary_scores_the_server_and_is_kept(make_window, engine_server,
                                                                 qtbot):
    """Servers → Add server with a quality canary → its perplexity in the table and the
    Monitor's chart, equal to the held-out text scored on the same server directly → kept
    across a restart of the window; a canary the server cannot get is refused in one sentence."""
    from monitor.canary import heldout_text, score

    window = make_window()
    servers, monitor = window.pane("servers"), window.pane("monitor")
    assert servers.service.wait_for_database(30)
    go_to(qtbot, window, "Servers")

    def with_canary(name: str, url: str, minutes: str, prometheus: bool = False,
                    decode_from: str = ""):
        calls: list[int] = []

        def answer(dialog) -> None:
            calls.append(1)
            if len(calls) > 1:  # shown again after the refusal: the user cancels it
                dialog.reject()
                return
            qtbot.keyClicks(dialog.name, name)
            dialog.url.selectAll()
            qtbot.keyClicks(dialog.url, url)
            if prometheus:
                dialog.api.setCurrentIndex(1)
            dialog.canary.lineEdit().selectAll()
            qtbot.keyClicks(dialog.canary, minutes)
            if decode_from:
                dialog.canary_decode.lineEdit().selectAll()
                qtbot.keyClicks(dialog.canary_decode, decode_from)
            ok = dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok)
            qtbot.mouseClick(ok, Qt.MouseButton.LeftButton)

        return answer

    answerer = DialogAnswerer(with_canary("watched", engine_server.url, "2"))
    qtbot.mouseClick(button(servers, "Add server"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "watched" in table_names(servers), timeout=15_000)
    answerer.stop()
    qtbot.waitUntil(lambda: "perplexity" in table_row(servers, "watched")["Quality canary"],
                    timeout=60_000)
    cell = table_row(servers, "watched")["Quality canary"]
    assert cell.startswith("every 2 min: perplexity ")

    # The same text scored on the same server by hand gives the same perplexity.
    direct = score(engine_server.url, None, heldout_text())
    go_to(qtbot, window, "Monitor")
    chart = monitor.charts["quality"]
    key = "watched-canary/canary_perplexity"
    qtbot.waitUntil(lambda: key in chart.data and chart.data[key][0].size > 0, timeout=15_000)
    drawn = float(chart.data[key][1][-1])
    assert drawn == pytest.approx(direct.perplexity, rel=1e-4)
    assert 1.0 < drawn < 1000.0 and direct.tokens > 100
    assert cell == f"every 2 min: perplexity {drawn:.3g}"

    # Scored again on demand (its next slot is two minutes away): Score canary now.
    go_to(qtbot, window, "Servers")
    scored = len(servers.service.hub.series("watched-canary/canary_tokens")[1])
    click_row(qtbot, servers.table, table_names(servers).index("watched"))
    qtbot.mouseClick(button(servers, "Score canary now"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(servers.service.hub.series("watched-canary/canary_tokens")[1])
                    > scored, timeout=60_000)
    assert any(n.message.startswith("Scoring watched's quality canary now")
               for n in window.notifications.notifications())

    # Scored by decoding from token 400 (the held-out text's last ~65 tokens decoded one at a
    # time through the server's cache): the reply said so, or the canary would show an error;
    # it scored exactly the decoded tokens.
    go_to(qtbot, window, "Servers")
    answerer = DialogAnswerer(with_canary("decoded", engine_server.url, "1", decode_from="400"))
    qtbot.mouseClick(button(servers, "Add server"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "decoded" in table_names(servers), timeout=15_000)
    answerer.stop()
    qtbot.waitUntil(lambda: "perplexity" in table_row(servers, "decoded")["Quality canary"],
                    timeout=90_000)
    assert table_row(servers, "decoded")["Quality canary"].startswith(
        "every 1 min, decoded from token 400: perplexity ")
    assert servers.service.servers["decoded"].canary_decode_from == 400
    tokens = servers.service.hub.series("decoded-canary/canary_tokens")[1]
    assert list(tokens[:1]) == [direct.tokens + 1 - 400]

    # Decoding without a canary interval is not a canary: the dialog says so in one sentence.
    answerer = DialogAnswerer(with_canary("nocanary", engine_server.url, "0", decode_from="64"))
    qtbot.mouseClick(button(servers, "Add server"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: QApplication.activeModalWidget() is None, timeout=10_000)
    answerer.stop()
    assert "nocanary" not in table_names(servers)
    assert any(n.message.startswith("scoring by decoding is a way of running the quality canary")
               for n in window.notifications.notifications())

    # A Prometheus server's API has no prompt to score: the dialog says so, nothing is added.
    answerer = DialogAnswerer(with_canary("fleet", "http://127.0.0.1:9090", "5", True))
    qtbot.mouseClick(button(servers, "Add server"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: QApplication.activeModalWidget() is None, timeout=10_000)
    answerer.stop()
    assert "fleet" not in table_names(servers)
    assert any(n.message.startswith("a quality canary scores text on the inference server")
               for n in window.notifications.notifications())
    assert raw_errors(window) == []
    window.close()

    # A new window on the same database watches it again, canary included.
    again = make_window()
    servers = again.pane("servers")
    assert servers.service.wait_for_database(30)
    qtbot.waitUntil(lambda: "watched" in table_names(servers), timeout=15_000)
    assert servers.service.servers["watched"].canary_every_s == 120.0
    assert servers.service.servers["decoded"].canary_decode_from == 400
    qtbot.waitUntil(lambda: "perplexity" in table_row(servers, "watched")["Quality canary"],
                    timeout=60_000)
