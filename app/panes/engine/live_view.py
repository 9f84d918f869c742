"""A small live view of the engine: requests, KV blocks in use, tokens/s, and a KV chart."""

from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import QFormLayout, QGroupBox, QLabel, QProgressBar, QVBoxLayout, QWidget

from app.engine_host import EngineHost
from app.panes.engine.kv_chart import KVChart
from app.panes.engine.spec_chart import SpecChart, acceptance_by_position

POLL_MS = 250


class LiveView(QGroupBox):
    """Polls the engine host's latest StepStats a few times a second while visible."""

    def __init__(self, host: EngineHost, parent: QWidget | None = None) -> None:
        super().__init__("Engine now", parent)
        self._host = host
        self.requests_label = QLabel("—")
        self.kv_bar = QProgressBar()
        self.kv_bar.setFormat("%v / %m blocks")
        self.rate_label = QLabel("—")
        self.spec_label = QLabel("off")
        self.spec_label.setToolTip("Share of draft tokens accepted, and tokens emitted per "
                                   "verification step (1 + accepted / drafts)")
        self.kv_chart = KVChart()
        self.spec_chart = SpecChart()
        self.spec_chart.setVisible(False)  # shown once speculation has drafted
        self._drawn_version = -1
        form = QFormLayout()
        form.addRow("Requests", self.requests_label)
        form.addRow("KV cache", self.kv_bar)
        form.addRow("Tokens/s", self.rate_label)
        form.addRow("Speculative", self.spec_label)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.spec_chart)
        layout.addWidget(self.kv_chart, 1)
        # Spyder's lesson: a hidden status widget must not keep polling.
        self._timer = QTimer(self, interval=POLL_MS)
        self._timer.timeout.connect(self.refresh)
        self.refresh()

    def refresh(self) -> None:
        """Read the latest figures off the host."""
        stats = self._host.stats()
        info = self._host.info
        if stats is None:
            self.requests_label.setText("0 running, 0 waiting")
            total = info.num_kv_blocks if info is not None else 0
            self._set_kv(0, total)
        else:
            self.requests_label.setText(f"{stats.num_running} running, {stats.num_waiting} waiting")
            self._set_kv(stats.kv_blocks_used, stats.kv_blocks_total)
        busy = self._host.state in ("generating", "benchmarking")
        self.rate_label.setText(f"{self._host.meter.rate():,.1f}" if busy else "idle")
        summary = self._host.spec_summary()
        self.spec_label.setText(_spec_text(summary))
        rates = acceptance_by_position(summary)
        self.spec_chart.setVisible(bool(rates))
        self.spec_chart.update_rates(rates)
        self._refresh_chart()

    def _refresh_chart(self) -> None:
        history = self._host.history
        if history.version != self._drawn_version:  # redraw only when steps arrived
            self._drawn_version = history.version
            self.kv_chart.update_series(history.series())

    def _set_kv(self, used: int, total: int) -> None:
        self.kv_bar.setRange(0, max(total, 1))
        self.kv_bar.setValue(min(used, max(total, 1)))
        self.kv_bar.setTextVisible(total > 0)

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt override)
        self._timer.start()
        super().showEvent(event)

    def hideEvent(self, event: QHideEvent) -> None:  # noqa: N802 (Qt override)
        self._timer.stop()
        super().hideEvent(event)


def _spec_text(summary: dict | None) -> str:
    """'off', 'no drafts yet', or the acceptance rate and mean accepted length."""
    if summary is None:
        return "off"
    if not summary["drafts"]:
        return f"{summary['method']}: no drafts yet"
    return (f"{summary['method']}: {summary['acceptance_rate']:.0%} accepted, "
            f"{summary['mean_accepted_length']:.2f} tokens per step")
