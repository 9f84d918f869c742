"""Journey 7: close the window and start again: window, pane, settings, servers, scenarios and
history are as they were."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt

from tests.app.test_journey_planner import SMALL, left_last_time, planner_window
from tests.app.test_journey_servers import add_server_by, go_to, table_names
from tests.app.user import button, menu_action, press, raw_errors


def test_journey_restart_keeps_everything(make_window, qtbot):
    from storage.db import open_database
    from storage.queries import save_run

    db = open_database(None)  # a load test `servescope loadtest --db` stored earlier
    save_run(db, "loadtest", "earlier", {}, {"completed": 8, "failed": 0}, time.time() - 600,
             time.time() - 590)
    db.close()
    left_last_time(SMALL)
    window, planner = planner_window(make_window, qtbot)
    qtbot.mouseClick(button(planner, "Keep as scenario"), Qt.MouseButton.LeftButton)
    servers, monitor = window.pane("servers"), window.pane("monitor")
    assert servers.service.wait_for_database(30)
    go_to(qtbot, window, "Servers")
    add_server_by(qtbot, window, servers, "button", "remote-a", "http://127.0.0.1:9")
    monitor.window_combo.setCurrentIndex(monitor.window_combo.findText("5 min"))
    menu_action(window, "View", "Dark theme").trigger()  # to the light theme
    window.resize(1300, 860)
    qtbot.wait(50)
    size = window.size()
    window.close()

    window = make_window()
    servers, monitor, history, planner = (window.pane(p) for p in
                                          ("servers", "monitor", "history", "planner"))
    assert window.rail.current_id() == "servers"
    assert window.size() == size
    assert window.settings.get("ui/theme") == "light" and not window.theme_action.isChecked()
    assert monitor.window_combo.currentText() == "5 min"
    assert servers.service.wait_for_database(30)
    qtbot.waitUntil(lambda: table_names(servers) == ["remote-a"], timeout=30_000)
    qtbot.waitUntil(lambda: history.runs_table.rowCount() == 1, timeout=30_000)
    assert history.runs_table.item(0, 2).text() == "earlier"
    table = planner.scenario_table
    qtbot.waitUntil(lambda: table.columnCount() == 1, timeout=30_000)
    assert table.horizontalHeaderItem(0).text() == "Llama-3.1-8B @ 4 req/s"
    assert planner.form.state().rate == SMALL.rate
    press(qtbot, window, "Ctrl+Shift+T")  # back to dark for the tests that follow
    assert window.settings.get("ui/theme") == "dark"
    assert raw_errors(window) == []
