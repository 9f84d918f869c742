"""The main window: navigation rail, panes, notifications, status bar, menus and start-up."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

from PySide6.QtCore import QSettings, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QKeySequence, QShowEvent
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.about import show_about
from app.engine_host import EngineHost
from app.navigation import NavigationRail, Pane, make_action
from app.notifications import NotificationArea
from app.panes.engine.pane import EnginePane
from app.panes.monitor.factory import monitor_panes
from app.panes.planner.pane import PlannerPane
from app.settings import Settings
from app.theme import apply_theme, current_theme

# Set by benchmarks/startup.py: quit as soon as the window is shown and print the time taken.
EXIT_AFTER_SHOW_ENV = "SERVESCOPE_EXIT_AFTER_SHOW"
STARTUP_T0_ENV = "SERVESCOPE_STARTUP_T0"


class MainWindow(QMainWindow):
    """servescope's one window: panes register into the rail; the engine thread lives here."""

    first_shown = Signal()

    def __init__(self, settings: Settings | None = None, start_panes: bool = True) -> None:
        super().__init__()
        self.settings = settings or Settings()
        self.setWindowTitle("servescope")
        self.setObjectName("servescope-main-window")
        self.host = EngineHost(self)
        self.notifications = NotificationArea()
        self._stack = QStackedWidget()
        self.rail = NavigationRail(self._stack)
        self.panes: list[Pane] = []
        self._start_panes = start_panes
        self.panes_started = False  # set once every pane has started, after the first paint
        self._shown = False
        self._closed = False
        self._build_central()
        self._build_status_bar()
        self._build_menus()
        self.register_pane(EnginePane(self.host, self.settings))
        self.register_pane(PlannerPane())
        for pane in monitor_panes(self.host, settings=self.settings):
            self.register_pane(pane)
        self.rail.select(self.settings.get("ui/pane"))
        self.rail.pane_selected.connect(lambda pane_id: self.settings.set("ui/pane", pane_id))
        self._restore_layout()

    # ---- construction
    def _build_central(self) -> None:
        right = QWidget()
        column = QVBoxLayout(right)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(self.notifications)
        column.addWidget(self._stack, 1)
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(self.rail)
        row.addWidget(right, 1)
        self.setCentralWidget(central)

    def _build_status_bar(self) -> None:
        self.device_label = QLabel("device: —")
        self.model_label = QLabel("model: none")
        self.state_label = QLabel("engine: no model")
        # Honest until the storage layer lands: nothing is recorded yet.
        self.database_label = QLabel("database: not configured")
        for label in (self.device_label, self.model_label, self.state_label, self.database_label):
            label.setContentsMargins(6, 0, 6, 0)
            self.statusBar().addPermanentWidget(label)
        self.host.state_changed.connect(self._on_engine_state)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction(make_action(self, "Quit", QKeySequence.StandardKey.Quit, self.close))
        self._panes_menu_anchor = self.menuBar().addMenu("&View")
        self.theme_action = make_action(self, "Dark theme", "Ctrl+Shift+T", self.toggle_theme)
        self.theme_action.setCheckable(True)
        self.theme_action.setChecked(current_theme() == "dark")
        self._panes_menu_anchor.addAction(self.theme_action)
        self._panes_menu_anchor.addSeparator()
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction(make_action(self, "About servescope",
                                        QKeySequence.StandardKey.HelpContents, self.show_about))

    def _restore_layout(self) -> None:
        geometry = self.settings.get("window/geometry")
        if geometry.isEmpty() or not self.restoreGeometry(geometry):
            self.resize(1200, 820)
        state = self.settings.get("window/state")
        if not state.isEmpty():
            self.restoreState(state)

    # ---- public API
    def register_pane(self, pane: Pane) -> None:
        """Add ``pane`` to the rail, its menu to the menu bar and Ctrl+N to reach it."""
        self.panes.append(pane)
        self.rail.add_pane(pane)
        pane.notify.connect(self.notifications.notify)
        menu = self.menuBar().addMenu(f"&{pane.title}")
        menu.addActions(pane.menu_actions())
        self.menuBar().insertMenu(self._panes_menu_anchor.menuAction(), menu)
        number = len(self.panes)
        goto = make_action(self, f"Go to {pane.title}", f"Ctrl+{number}",
                            lambda: self.rail.select(pane.pane_id))
        self._panes_menu_anchor.addAction(goto)

    def pane(self, pane_id: str) -> Pane:
        """The registered pane ``pane_id``."""
        return next(p for p in self.panes if p.pane_id == pane_id)

    def toggle_theme(self) -> None:
        """Switch between the dark and the light palette and remember the choice."""
        theme = "light" if current_theme() == "dark" else "dark"
        apply_theme(QApplication.instance(), theme)
        self.settings.set("ui/theme", theme)
        self.theme_action.setChecked(theme == "dark")

    def show_about(self) -> None:
        """Show the About box with versions."""
        show_about(self, self.settings.path)

    # ---- Qt events
    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt override)
        super().showEvent(event)
        if not self._shown:
            self._shown = True
            # After the first paint: background work starts only once the window is up.
            QTimer.singleShot(0, self._after_first_show)

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt override)
        if not self._closed:
            self._closed = True
            self._save()
            for pane in self.panes:
                pane.shutdown()
            self.host.shutdown()
        super().closeEvent(event)

    # ---- internals
    def _after_first_show(self) -> None:
        self.first_shown.emit()
        if self._start_panes and not self._closed:
            for pane in self.panes:
                pane.start()
            self.panes_started = True
            for pane in self.panes:
                if hasattr(pane, "database_status"):
                    self.database_label.setText(pane.database_status())
                    pane.database_changed.connect(self.database_label.setText)

    def _save(self) -> None:
        for pane in self.panes:
            pane.save()
        self.settings.set("window/geometry", self.saveGeometry())
        self.settings.set("window/state", self.saveState())
        self.settings.sync()

    def _on_engine_state(self, state: str) -> None:
        self.state_label.setText(f"engine: {state}")
        info = self.host.info
        self.model_label.setText(f"model: {info.model_name}" if info else "model: none")
        if info is None:
            self.device_label.setText("device: —")
        else:
            fallback = " (fallback)" if info.fallback_reason else ""
            self.device_label.setText(f"device: {info.device} {info.dtype}{fallback}")
            self.device_label.setToolTip(info.fallback_reason or "")


def _report_startup(window: MainWindow) -> None:
    t0 = float(os.environ.get(STARTUP_T0_ENV, "0") or 0)
    print(json.dumps({"shown_s": time.time() - t0 if t0 else None,
                      "torch_imported": "torch" in sys.modules}), flush=True)
    window.close()


def run_app(argv: Sequence[str]) -> int:
    """Open the main window and run the event loop; returns the exit status."""
    app = QApplication.instance() or QApplication(list(argv))
    app.setOrganizationName("servescope")
    app.setApplicationName("servescope")
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    settings = Settings()
    apply_theme(app, settings.get("ui/theme"))
    exit_after_show = os.environ.get(EXIT_AFTER_SHOW_ENV) == "1"
    window = MainWindow(settings, start_panes=not exit_after_show)
    if exit_after_show:
        window.first_shown.connect(lambda: _report_startup(window))
    window.show()
    return app.exec()
