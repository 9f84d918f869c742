"""Benchmark panel: run the engine benchmark in the background and show its results table."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.engine_host import EngineHost
from app.navigation import on_click
from app.panes.engine.state import configuration_text

CONCURRENCIES = ("1", "4", "16", "64")
COLUMNS = ("When", "Model", "Device", "Configuration", "Prefill tok/s", "TTFT ms", "Decode tok/s",
           *(f"Throughput @{c}" for c in CONCURRENCIES))


def result_row(result: dict[str, Any]) -> list[str]:
    """One table row for a benchmark result dict (missing figures show as —)."""
    when = result.get("finished_at")
    when_text = time.strftime("%Y-%m-%d %H:%M", time.localtime(when)) \
        if isinstance(when, int | float) else str(when or "now")
    throughput = result.get("throughput_tokens_per_s") or {}
    return [when_text, str(result.get("model", "—")), str(result.get("device", "—")),
            configuration_text(result.get("configuration")),
            _num(result.get("prefill_tokens_per_s")), _num(result.get("ttft_ms")),
            _num(result.get("decode_tokens_per_s")),
            *(_num(throughput.get(c)) for c in CONCURRENCIES)]


def finished_message(result: dict[str, Any]) -> str:
    """What became of a finished benchmark: saved, and whether the planner can calibrate
    from it (only a CUDA GPU's figures map onto a catalog GPU)."""
    if str(result.get("device", "")).startswith("cuda"):
        return ("Benchmark finished and saved with its configuration; Planner → Calibrate… "
                "fits the planner to it.")
    return ("Benchmark finished and saved with its configuration (see History). It ran on "
            f"{result.get('device', 'the CPU')}, so it cannot calibrate the planner's GPUs.")


def _num(value: Any) -> str:
    return f"{value:,.1f}" if isinstance(value, int | float) else "—"


class BenchPanel(QGroupBox):
    """Run / cancel the benchmark; past results (kept for the planner's calibration) below."""

    notify = Signal(str, str)

    def __init__(self, host: EngineHost, parent: QWidget | None = None) -> None:
        super().__init__("Benchmark", parent)
        self._host = host
        self.run_button = QPushButton("Run benchmark")
        self.quick_box = QCheckBox("Quick", checked=True)
        self.quick_box.setToolTip("Fewer and shorter requests: seconds instead of minutes")
        self.cancel_button = QPushButton("Cancel")
        self.progress = QProgressBar()
        self.message = QLabel()
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self._build()
        host.state_changed.connect(self.set_state)
        host.bench_progress.connect(self._on_progress)
        host.bench_finished.connect(self._on_finished)
        host.bench_failed.connect(self._on_failed)
        host.bench_cancelled.connect(self._on_cancelled)
        on_click(self.run_button.clicked, self.run)
        on_click(self.cancel_button.clicked, host.cancel_benchmark)
        self.set_state(host.state)

    def _build(self) -> None:
        row = QHBoxLayout()
        row.addWidget(self.run_button)
        row.addWidget(self.quick_box)
        row.addWidget(self.cancel_button)
        row.addWidget(self.progress, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.message)
        layout.addWidget(self.table, 1)

    def run(self) -> None:
        """Start the benchmark on the loaded model."""
        if self.run_button.isEnabled():
            self.progress.setValue(0)
            self.message.setText("Starting the benchmark…")
            self._host.benchmark(quick=self.quick_box.isChecked())

    def load_history(self) -> None:
        """Show the results saved by earlier runs (reads a small file; call after start-up)."""
        try:
            from engine.bench import load_results

            results = load_results()
        except Exception as exc:  # a damaged history file must not stop the app
            self.notify.emit("warning", f"Could not read earlier benchmark results: {exc}")
            return
        for result in results:
            self._add_row(result)

    def set_state(self, state: str) -> None:
        """Enable run only with a model loaded and nothing else running."""
        running = state == "benchmarking"
        self.run_button.setEnabled(state == "ready")
        self.cancel_button.setEnabled(running)
        self.progress.setVisible(running)

    def _on_progress(self, fraction: float, message: str) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(fraction * 1000))
        self.message.setText(message)

    def _on_finished(self, result: dict[str, Any]) -> None:
        self.message.setText(finished_message(result))
        self._add_row(result)
        self.table.scrollToBottom()

    def _on_failed(self, message: str) -> None:
        self.message.setText("")
        self.notify.emit("error", message)

    def _on_cancelled(self) -> None:
        self.message.setText("Benchmark cancelled.")

    def _add_row(self, result: dict[str, Any]) -> None:
        row = self.table.rowCount()
        self.table.insertRow(row)
        for column, text in enumerate(result_row(result)):
            self.table.setItem(row, column, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()
