"""GUI test set-up: offscreen Qt, isolated settings and data, and failure on any Qt warning."""

from __future__ import annotations

import os

# Before anything imports Qt. The screen file gives the offscreen platform a 1600x1000 screen
# (its default is 800x800, smaller than the window, which would clamp restored geometry).
_SCREEN = os.path.join(os.path.dirname(__file__), "offscreen-screen.json")
if os.environ.get("QT_QPA_PLATFORM", "offscreen") == "offscreen":
    os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={_SCREEN}"

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QSettings, QtMsgType, qInstallMessageHandler  # noqa: E402

# The offscreen platform warns about a window-manager feature it lacks; it says nothing about us.
IGNORED = (r"This plugin does not support propagateSizeHints\(\)",)
_IGNORED_PREFIXES = tuple(p.replace("\\", "") for p in IGNORED)
_recorded: list[str] = []


def _record(mode: QtMsgType, _context: object, message: str) -> None:
    if mode in (QtMsgType.QtDebugMsg, QtMsgType.QtInfoMsg) or message.startswith(_IGNORED_PREFIXES):
        return
    _recorded.append(message)


# pytest-qt captures messages during set-up and the test itself (failing the test at WARNING, see
# below); this handler catches the rest: fixture teardown, where windows close and threads stop.
qInstallMessageHandler(_record)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.qt_log_level_fail("WARNING"))
            item.add_marker(pytest.mark.qt_log_ignore(*IGNORED))


@pytest.fixture(autouse=True)
def no_qt_warnings() -> Iterator[None]:
    """Fail the test if Qt warned while its fixtures were torn down (windows closed)."""
    _recorded.clear()
    yield
    warnings, _recorded[:] = list(_recorded), []
    assert not warnings, f"Qt warned during teardown: {warnings}"


@pytest.fixture(autouse=True)
def isolated_settings(qapp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Settings, the model registry and benchmark results in a per-test folder."""
    from app.theme import apply_theme

    folder = tmp_path / "settings"
    qapp.setOrganizationName("servescope-tests")
    qapp.setApplicationName("servescope-tests")
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(folder))
    monkeypatch.setenv("SERVESCOPE_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("SERVESCOPE_DATA_DIR", str(tmp_path / "data"))
    apply_theme(qapp, "dark")
    return folder


@pytest.fixture
def make_window(qtbot) -> Iterator[Callable[[], object]]:
    """A factory of shown main windows; every one is closed (threads stopped) at teardown."""
    from app.main_window import MainWindow

    windows: list[MainWindow] = []

    def make() -> MainWindow:
        window = MainWindow()
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        windows.append(window)
        # The panes start just after the first paint; tests act on a started window.
        qtbot.waitUntil(lambda: window.panes_started, timeout=10_000)
        return window

    yield make
    for window in windows:
        window.close()


LOAD_TIMEOUT_MS = 120_000


def load_model(qtbot, window, model: Path | str, context: int = 512, concurrency: int = 1) -> None:
    """Choose ``model`` in the Engine pane, load it, and wait until it is ready."""
    pane = window.pane("engine")
    assert pane.picker.add_path(str(model))
    pane.load_panel.context_spin.setValue(context)
    pane.load_panel.concurrency_spin.setValue(concurrency)
    pane.load_panel.device_combo.setCurrentIndex(pane.load_panel.device_combo.findData("cpu"))
    with qtbot.waitSignal(pane.host.loaded, timeout=LOAD_TIMEOUT_MS):
        pane.load_panel.load_button.click()
    qtbot.waitUntil(lambda: pane.host.state == "ready")


@pytest.fixture
def loaded_window(make_window, qtbot, demo_gguf: Path):
    """A window with the demo model loaded on the CPU."""
    window = make_window()
    load_model(qtbot, window, demo_gguf)
    return window
