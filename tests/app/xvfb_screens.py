"""The README's screenshots, taken from a real X server: run by test_screenshots.py under Xvfb.

A plain ``pytest`` run does not collect this module (its name does not start with ``test_``): one
process keeps the Qt platform it started with, and the rest of the suite runs offscreen, so
test_screenshots.py starts Xvfb and runs this module in a child pytest with QT_QPA_PLATFORM=xcb.
Each picture is the X server's own framebuffer (the root window), which the main window fills:
Xvfb has no window manager, hence no title bar or frame around it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from app.panes.monitor.state import ServerEntry
from tests.app.test_monitor_panes import _own_panes, engine_server  # noqa: F401 (a fixture)
from tests.app.test_planner_pane import SMALL, _search

SHOTS = Path(os.environ.get("SERVESCOPE_SHOTS_DIR", "."))


@pytest.fixture(autouse=True)
def real_x_server(qapp) -> None:
    if QApplication.platformName() != "xcb":
        platform = QApplication.platformName()
        pytest.fail(f"run this under an X server (QT_QPA_PLATFORM=xcb), not {platform}")


def shoot(qtbot, window, name: str) -> None:
    """Fill the X screen with ``window`` and save the screen's framebuffer as ``name``.png."""
    screen = window.screen()
    window.notifications.clear()
    window.setGeometry(screen.geometry())
    qtbot.waitUntil(lambda: window.frameGeometry() == screen.geometry(), timeout=5_000)
    qtbot.wait(400)  # let the X server draw what the last events changed
    image = screen.grabWindow(0).toImage()
    assert (image.width(), image.height()) == (screen.size().width(), screen.size().height())
    SHOTS.mkdir(parents=True, exist_ok=True)
    assert image.save(str(SHOTS / f"{name}.png"))


def test_engine_pane(loaded_window, qtbot) -> None:
    window = loaded_window
    pane = window.pane("engine")
    pane.chat.sampling.temperature.setValue(0.0)
    pane.chat.sampling.max_tokens.setValue(48)
    pane.chat.input.setPlainText("In two sentences, what does a KV cache do?")
    with qtbot.waitSignal(pane.chat.reply_done, timeout=120_000):
        pane.chat.send_button.click()
    for theme in ("dark", "light"):
        if (theme == "dark") != window.theme_action.isChecked():  # "Dark theme", checkable
            window.theme_action.trigger()
        shoot(qtbot, window, f"engine-{theme}")


def test_planner_pane(make_window, qtbot) -> None:
    window = make_window()
    window.rail.select("planner")
    pane = window.pane("planner")
    _search(qtbot, pane, replace(SMALL, gpus=("L4", "L40S", "A100 80GB", "H100 SXM")))
    pane.tabs.setCurrentIndex(1)
    shoot(qtbot, window, "planner")
    pane.tabs.setCurrentIndex(0)
    shoot(qtbot, window, "planner-ranking")


def test_monitor_pane(make_window, engine_server, qtbot) -> None:  # noqa: F811 (the fixture)
    window = make_window()
    monitor, servers, history = _own_panes(window)
    assert servers.add_server(ServerEntry("local", engine_server.url, dollars_per_hour=2.5))
    dialog = servers.open_load_test()
    qtbot.addWidget(dialog)
    dialog.requests.setValue(16)
    dialog.concurrency.setValue(2)  # a longer load: the charts draw lines, not points
    dialog.output_len.setValue(24)
    dialog.input_len.setValue(16)
    with qtbot.waitSignal(history.loaded, timeout=60_000):
        dialog.start_button.click()
    dialog.close()
    qtbot.waitUntil(lambda: monitor.charts["ttft"].point_count() >= 6, timeout=10_000)
    # A deliberately tight 1 ms TTFT objective, so the picture shows the alert banner.
    monitor.slo_ttft.setValue(1)
    qtbot.waitUntil(lambda: "(above 0.001)" in monitor.alert_banner.text(), timeout=20_000)
    window.rail.select("monitor")
    shoot(qtbot, window, "monitor")
