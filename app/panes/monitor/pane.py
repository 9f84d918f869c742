"""The Monitor pane: live charts fed by the hub, a window selector, pause, filter and SLO alerts."""

from __future__ import annotations

import time

import numpy as np
from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.navigation import PageMixin, make_actions, on_click
from app.panes.monitor.charts import ChartView
from app.panes.monitor.diagnosis import DiagnosisView
from app.panes.monitor.service import MonitorService
from app.panes.monitor.state import (
    CHARTS,
    WINDOWS,
    aligned,
    band_keys,
    chart_series,
    merge_history,
)
from app.settings import Settings
from app.workers import Progress, TaskRunner

REFRESH_MS = 500  # 2 Hz: well under pyqtgraph's 10 Hz budget, smooth enough for 1 s polling
HISTORY_REFRESH_S = 15.0  # at most; a 1-minute window re-reads the database every 5 s
ALL_SOURCES = "All sources"


class ServiceBridge(QObject):
    """Carries the service's errors from its threads to the GUI thread."""

    error = Signal(str)
    database = Signal()  # the database opened, or failed to


class MonitorPane(PageMixin, QWidget):
    """Live charts of GPUs, the engine and remote servers; older data from the database."""

    pane_id = "monitor"
    title = "Monitor"
    notify = Signal(str, str)
    database_changed = Signal(str)  # the status bar's database entry

    def __init__(self, service: MonitorService, bridge: ServiceBridge,
                 settings: Settings | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self._settings = settings if settings is not None else Settings()
        service.acquire()
        bridge.error.connect(lambda message: self.notify.emit("error", message))
        bridge.database.connect(self._on_database)
        self.charts = {spec.chart_id: ChartView(spec) for spec in CHARTS}
        self.window_combo = QComboBox()
        for label, seconds in WINDOWS:
            self.window_combo.addItem(label, seconds)
        # A window no longer offered (an edited settings file) falls back to the first.
        self.window_combo.setCurrentIndex(
            max(0, self.window_combo.findData(self._settings.get("monitor/window_s"))))
        self.source_combo = QComboBox()
        self.source_combo.addItem(ALL_SOURCES, None)
        self.pause_button = QPushButton("Pause", checkable=True)
        self.slo_ttft = _ms_spin(self._settings.get("monitor/slo_ttft_ms"))
        self.slo_tpot = _ms_spin(self._settings.get("monitor/slo_tpot_ms"))
        self.status_label = QLabel("monitor: starting")
        self.alert_banner = QLabel()
        self.alert_banner.setObjectName("alert-banner")
        self.alert_banner.setStyleSheet("QLabel#alert-banner { background: #5c1f1f; color: white;"
                                        " padding: 6px; border-left: 4px solid #e15759; }")
        self.alert_banner.setWordWrap(True)
        self.alert_banner.setVisible(False)
        # Long texts wrap or clip instead of widening the whole window past the screen.
        for label in (self.alert_banner, self.status_label):
            label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._history: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._history_at = 0.0
        self._history_runner = TaskRunner(self)
        self._history_runner.succeeded.connect(self._on_history)
        self._history_runner.failed.connect(lambda m: self.notify.emit("error", m))
        self._timer = QTimer(self, interval=REFRESH_MS)
        self._timer.timeout.connect(self.refresh)
        self.diagnosis = DiagnosisView(service)
        self.diagnosis.notify.connect(self.notify)
        # Diagnose now from the menu or its shortcut shows what it found.
        on_click(self.diagnosis.actions[0].triggered,
                 lambda: self.tabs.setCurrentWidget(self.diagnosis))
        self.tabs = QTabWidget()
        self._build()
        self._connect()
        self._actions = self._make_actions()

    def _build(self) -> None:
        bar = QHBoxLayout()
        for label, widget in (("Window", self.window_combo), ("Source", self.source_combo),
                              ("SLO p99 TTFT", self.slo_ttft), ("TPOT", self.slo_tpot)):
            bar.addWidget(QLabel(label))
            bar.addWidget(widget)
        bar.addWidget(self.pause_button)
        bar.addStretch(1)
        grid_host = QWidget()
        grid = QGridLayout(grid_host)
        grid.setContentsMargins(0, 0, 0, 0)
        for i, chart in enumerate(self.charts.values()):
            grid.addWidget(chart, i // 3, i % 3)
        scroll = QScrollArea(widgetResizable=True)
        scroll.setWidget(grid_host)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addLayout(bar)
        layout.addWidget(self.status_label)
        layout.addWidget(self.alert_banner)
        self.tabs.addTab(scroll, "Charts")
        self.tabs.addTab(self.diagnosis, "Diagnosis")
        layout.addWidget(self.tabs, 1)
        self._apply_slo()

    def _connect(self) -> None:
        self.window_combo.currentIndexChanged.connect(self._on_view_changed)
        self.source_combo.currentIndexChanged.connect(self._on_view_changed)
        self.pause_button.toggled.connect(self._on_paused)
        self.slo_ttft.valueChanged.connect(self._apply_slo)
        self.slo_tpot.valueChanged.connect(self._apply_slo)
        for chart in self.charts.values():
            chart.export_requested.connect(self._export)

    def _make_actions(self) -> list[QAction]:
        return make_actions(self, (
            ("Pause / resume charts", "Ctrl+Shift+P", self.pause_button.toggle),
            ("Export TTFT chart as PNG…", "Ctrl+Alt+P", lambda: self._export("ttft", "png")),
        )) + self.diagnosis.actions

    # ---- Pane protocol
    def start(self) -> None:
        """Open the database, start the hub and begin refreshing the charts."""
        self.service.start()
        self._timer.start()
        self.diagnosis.start()
        self.refresh()

    def database_status(self) -> str:
        """The status bar's database entry: where samples go, or why they do not."""
        service = self.service
        if service.db is not None:
            return f"database: {service.db.url}"
        if service.db_error:
            return "database: unavailable (nothing recorded)"
        return "database: opening…" if service.db_opening else "database: not opened yet"

    def _on_database(self) -> None:
        self._update_status()
        self.database_changed.emit(self.database_status())

    def save(self) -> None:
        """Keep the chosen window and the SLOs for the next start."""
        self._settings.set("monitor/window_s", self.window_s())
        self._settings.set("monitor/slo_ttft_ms", self.slo_ttft.value())
        self._settings.set("monitor/slo_tpot_ms", self.slo_tpot.value())

    def shutdown(self) -> None:
        """Stop the refresh timer and the history query; the last pane stops the hub."""
        self._timer.stop()
        self._history_runner.stop()
        self.diagnosis.shutdown()
        self.service.release()

    # ---- refresh
    def window_s(self) -> float:
        """The chosen window in seconds."""
        return float(self.window_combo.currentData())

    def source_filter(self) -> str | None:
        """The chosen source, or None for all."""
        return self.source_combo.currentData()

    def refresh(self) -> None:
        """Pull the hub's ring buffers into the charts (and stored points for long windows)."""
        hub = self.service.hub
        self._update_status()
        if hub is None:
            return
        self._update_sources(list(set(hub.series_keys()) | set(self._history)))
        self._update_alerts()
        if self.pause_button.isChecked():
            return
        now = time.time()
        since = now - self.window_s()
        # Every window reads the database too: samples another process records (`servescope
        # record`, an earlier session) are in no ring buffer of this hub.
        if now - self._history_at > min(HISTORY_REFRESH_S, self.window_s() / 12):
            self._fetch_history(since, now)
        keys = sorted(set(hub.series_keys()) | set(self._history))
        for spec in CHARTS:
            drawn = chart_series(spec, keys, self.source_filter())
            data = {key: self._series(hub, key, since) for key in drawn}
            # The bucket each histogram p99 lies in, as a band behind its line.
            bands = {key: aligned(self._series(hub, lo, since), self._series(hub, hi, since))
                     for key, (lo, hi) in band_keys(drawn, keys).items()}
            self.charts[spec.chart_id].update_series(data, (since, now), bands)

    def _series(self, hub, key: str, since: float) -> tuple:
        """A series' live points, after the stored ones older than the live buffer."""
        ts, values = hub.series(key, since=since)
        if key in self._history:
            ts, values = merge_history(*self._history[key], ts, values)
        return ts, values

    def _update_status(self) -> None:
        parts = [self.service.gpu_message or "GPUs: —"]
        if self.service.db_error:
            parts.append("database: not recording")
        elif self.service.db is not None:
            parts.append("recording")
        elif self.service.db_opening:
            parts.append("opening database…")
        self.status_label.setText(" · ".join(parts))

    def _update_sources(self, keys: list[str]) -> None:
        from app.panes.monitor.state import source_of

        names = sorted({source_of(k) for k in keys} | set(self.service.servers))
        have = {self.source_combo.itemData(i) for i in range(1, self.source_combo.count())}
        for name in names:
            if name not in have:
                self.source_combo.addItem(name, name)

    def _update_alerts(self) -> None:
        events = self.service.firing()
        self.alert_banner.setVisible(bool(events))
        if events:
            self.alert_banner.setText("SLO breached — " + "; ".join(e.message for e in events))

    def _fetch_history(self, start: float, end: float) -> None:
        db = self.service.db
        if db is None or self._history_runner.is_running():
            return
        self._history_at = time.time()

        def task(cancel):
            from storage.queries import list_series, series_window

            stored = list_series(db)
            keys = [k for spec in CHARTS for k in chart_series(spec, stored)]
            keys += [k for pair in band_keys(keys, stored).values() for k in pair]
            out = {}
            for i, key in enumerate(keys):
                if cancel.is_set():
                    return out
                out[key] = series_window(db, key, start, end)
                yield Progress((i + 1) / max(1, len(keys)), key)
            return out

        self._history_runner.start(task)

    def _on_history(self, result: dict) -> None:
        self._history = result or {}
        self.refresh()

    # ---- controls
    def _on_view_changed(self) -> None:
        self._history, self._history_at = {}, 0.0
        self.refresh()

    def _on_paused(self, paused: bool) -> None:
        self.pause_button.setText("Resume" if paused else "Pause")
        for chart in self.charts.values():
            # While paused the user may zoom and pan freely; x follows the window otherwise.
            chart.plot.getPlotItem().setMouseEnabled(x=paused, y=paused)
            chart.forget_y_range()
        if not paused:
            self.refresh()

    def _apply_slo(self) -> None:
        ttft, tpot = self.slo_ttft.value(), self.slo_tpot.value()
        self.service.set_slo(ttft, tpot)
        self.charts["ttft"].set_slo(ttft)
        self.charts["tpot"].set_slo(tpot)

    def _export(self, chart_id: str, fmt: str) -> None:
        chart = self.charts[chart_id]
        pattern = "PNG image (*.png)" if fmt == "png" else "CSV file (*.csv)"
        path, _ = QFileDialog.getSaveFileName(self, f"Export {chart.spec.title}",
                                              f"{chart_id}.{fmt}", pattern)
        if not path:
            return
        try:
            chart.export_png(path) if fmt == "png" else chart.export_csv(path)
        except OSError as exc:
            self.notify.emit("error", f"Could not write {path}: {exc.strerror or exc}.")
            return
        self.notify.emit("info", f"Saved {path}.")


def _ms_spin(value: float) -> QDoubleSpinBox:
    spin = QDoubleSpinBox(decimals=0, minimum=1, maximum=600_000, suffix=" ms", value=value)
    spin.setAlignment(Qt.AlignmentFlag.AlignRight)
    return spin
