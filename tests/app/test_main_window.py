"""The main window without a model: rail, status bar, notifications, settings, About, start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication

from app.about import about_text, versions
from app.main_window import EXIT_AFTER_SHOW_ENV, STARTUP_T0_ENV
from app.notifications import NotificationArea
from app.settings import DEFAULTS, Settings
from app.theme import current_theme

REPO = Path(__file__).resolve().parents[2]


def test_window_has_its_panes_and_an_honest_status_bar(make_window, qtbot) -> None:
    window = make_window()
    assert window.rail.pane_ids() == ["engine", "planner", "monitor", "servers", "history"]
    assert window.rail.current_id() == "engine"
    # The monitor opens (and migrates) its database on a worker thread after the window shows.
    qtbot.waitUntil(lambda: window.database_label.text().startswith("database: sqlite:///"),
                    timeout=30_000)
    assert window.state_label.text() == "engine: no model"
    assert window.model_label.text() == "model: none"
    menus = [a.text() for a in window.menuBar().actions()]
    assert menus == ["&File", "&Engine", "&Planner", "&Monitor", "&Servers", "&History", "&View",
                     "&Help"]


def test_no_two_actions_share_a_shortcut(make_window) -> None:
    # Qt fires neither action of an ambiguous shortcut, so a clash silently disables both.
    from collections import defaultdict

    from PySide6.QtGui import QAction

    window = make_window()
    owners: dict[str, list[str]] = defaultdict(list)
    for action in window.findChildren(QAction):
        for key in action.shortcuts():
            if key.toString():
                owners[key.toString()].append(action.text())
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}


def test_shortcuts_cover_the_common_actions(make_window) -> None:
    window = make_window()
    shortcuts = {a.text(): a.shortcut().toString() for a in window.pane("engine").menu_actions()}
    assert shortcuts["Load model"] == "Ctrl+L"
    assert shortcuts["Send message"] == "Ctrl+Return"
    assert shortcuts["Stop generating"] == "Esc"
    assert shortcuts["Run benchmark"] == "Ctrl+B"
    assert window.theme_action.shortcut().toString() == "Ctrl+Shift+T"


def test_settings_persist_across_a_window_restart(make_window, qtbot) -> None:
    window = make_window()
    pane = window.pane("engine")
    pane.chat.sampling.temperature.setValue(0.35)
    pane.chat.sampling.seed.setValue(1234)
    pane.chat.system_prompt.setPlainText("Answer in one word.")
    pane.load_panel.context_spin.setValue(4096)
    window.toggle_theme()
    window.resize(1100, 760)
    qtbot.waitUntil(lambda: (window.width(), window.height()) == (1100, 760))
    window.close()

    assert Settings().get("chat/temperature") == 0.35
    assert isinstance(Settings().get("engine/context_tokens"), int)
    again = make_window()
    pane = again.pane("engine")
    assert pane.chat.sampling.temperature.value() == 0.35
    assert pane.chat.sampling.seed.value() == 1234
    assert pane.chat.system_prompt.toPlainText() == "Answer in one word."
    assert pane.load_panel.context_spin.value() == 4096
    assert Settings().get("ui/theme") == "light" and current_theme() == "light"
    assert (again.width(), again.height()) == (1100, 760)


def test_settings_read_back_as_their_default_types(isolated_settings) -> None:
    settings = Settings()
    for key, default in DEFAULTS.items():
        assert type(settings.get(key)) is type(default), key
    settings.set("chat/top_k", 40)
    settings.sync()
    assert Settings().get("chat/top_k") == 40
    assert str(isolated_settings) in settings.path


def test_notifications_never_block_and_errors_stay(qtbot) -> None:
    area = NotificationArea()
    qtbot.addWidget(area)
    area.show()
    area.notify("error", "Model file <x.gguf> is corrupt")
    area.notify("info", "Loaded")
    assert [n.level for n in area.notifications()] == ["error", "info"]
    assert area.isVisible()
    for i in range(6):
        area.notify("warning", f"w{i}")
    assert len(area.notifications()) == 4  # the oldest give way
    area.clear()
    assert not area.isVisible()


def test_about_lists_versions_without_importing_torch() -> None:
    info = versions()
    assert set(info) >= {"servescope", "Python", "Qt", "PySide6", "PyTorch"}
    assert "<table" in about_text("/tmp/x.ini")


def test_window_shows_before_torch_is_imported() -> None:
    env = {**os.environ, EXIT_AFTER_SHOW_ENV: "1", STARTUP_T0_ENV: repr(time.time()),
           "QT_QPA_PLATFORM": "offscreen", "SERVESCOPE_CONFIG_DIR": "/nonexistent-servescope"}
    code = "import sys; from app.main_window import run_app; sys.exit(run_app(sys.argv))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["torch_imported"] is False
    assert report["shown_s"] > 0


def test_theme_toggles_the_palette(make_window) -> None:
    window = make_window()
    dark = QApplication.instance().palette().window().color().lightness()
    window.toggle_theme()
    light = QApplication.instance().palette().window().color().lightness()
    assert light > dark
    assert not window.theme_action.isChecked()
