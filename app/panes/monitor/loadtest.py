"""The load-test dialog: monitor.loadgen against a server in the background, shown and stored."""

from __future__ import annotations

import re
import threading

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.navigation import on_click
from app.panes.monitor.service import MonitorService
from app.panes.monitor.state import ServerEntry, fmt
from app.workers import Progress, TaskRunner, relay

LATENCIES = (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"),
             ("E2E (ms)", "e2e_ms"))
THROUGHPUTS = (("Requests/s", "request_throughput"), ("Output tokens/s", "output_tokens_per_s"),
               ("Completed", "completed"), ("Failed", "failed"), ("Duration (s)", "duration_s"))


_TYPE_PREFIX = re.compile(r"^\s*[A-Z][A-Za-z]*(Error|Exception|Timeout)\s*:\s*")


def request_error_sentence(error: str) -> str:
    """A failed request's error as a user reads it: the load generator records
    "ConnectError: All connection attempts failed"; the type name means nothing to a user."""
    text = _TYPE_PREFIX.sub("", error).strip().rstrip(".") or "no details were given"
    return text[0].upper() + text[1:]


def result_rows(summary: dict) -> list[list[str]]:
    """The results table: one row per latency (p50, p95, p99, mean) and per throughput figure."""
    rows = [[label] + [fmt(summary[key].get(k)) for k in ("p50", "p95", "p99", "mean")]
            for label, key in LATENCIES]
    rows += [[label, fmt(summary.get(key)), "", "", ""] for label, key in THROUGHPUTS]
    return rows


class LoadTestDialog(QDialog):
    """Sends a bounded load to one server; the run and its requests are stored for History."""

    run_stored = Signal(int)
    notify = Signal(str, str)

    def __init__(self, entry: ServerEntry, service: MonitorService,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Load test — {entry.name}")
        self.entry = entry
        self.service = service
        self.summary: dict | None = None
        self.run_id: int | None = None
        self.requests = _spin(1, 100_000, 32)
        self.concurrency = _spin(1, 1024, 4)
        self.input_len = _spin(1, 100_000, 64)
        self.output_len = _spin(1, 100_000, 64)
        self.endpoint = QComboBox()
        self.endpoint.addItems(["completions", "chat"])
        self.progress = QProgressBar(maximum=1000)
        self.message = QLabel("")
        self.start_button = QPushButton("Start")
        self.close_button = QPushButton("Close")
        self.table = QTableWidget(0, 5)
        self.table.setHorizontalHeaderLabels(["", "p50", "p95", "p99", "mean"])
        self.table.verticalHeader().setVisible(False)
        self.runner = TaskRunner(self)
        self._build()
        self.runner.progressed.connect(self._on_progress)
        self.runner.succeeded.connect(self._on_done)
        self.runner.failed.connect(self._on_failed)
        on_click(self.start_button.clicked, self.start)
        on_click(self.close_button.clicked, self.close)

    def _build(self) -> None:
        form = QFormLayout()
        form.addRow("URL", QLabel(self.entry.url))
        for label, widget in (("Requests", self.requests), ("Concurrency", self.concurrency),
                              ("Input words", self.input_len), ("Output tokens", self.output_len),
                              ("Endpoint", self.endpoint)):
            form.addRow(label, widget)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.close_button)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.progress)
        layout.addWidget(self.message)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        self.resize(560, 520)

    def spec(self):
        """The LoadSpec the controls describe (the token resolved from its reference)."""
        from monitor.loadgen import LoadSpec
        from monitor.remote import resolve_token

        return LoadSpec(url=self.entry.url, endpoint=self.endpoint.currentText(),
                        concurrency=self.concurrency.value(), requests=self.requests.value(),
                        input_len=self.input_len.value(), output_len=self.output_len.value(),
                        token=resolve_token(self.entry.token_ref or None))

    def start(self) -> None:
        """Run the load test in the background."""
        try:
            spec = self.spec()
        except ValueError as exc:
            self.notify.emit("error", f"Load test of {self.entry.name}: {exc}")
            return
        self.start_button.setEnabled(False)
        self.progress.setValue(0)
        self.message.setText("sending…")
        self.runner.start(_load_task(spec, self.entry.name, self.service.db))

    def _on_progress(self, progress: Progress) -> None:
        self.progress.setValue(int((progress.fraction or 0) * 1000))
        self.message.setText(progress.message)

    def _on_done(self, result: tuple) -> None:
        self.summary, self.run_id, store_error = result
        self.start_button.setEnabled(True)
        self.progress.setValue(1000)
        rows = result_rows(self.summary)
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                self.table.setItem(r, c, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()
        done = f"{self.summary['completed']} completed, {self.summary['failed']} failed"
        if self.summary.get("errors"):
            done += f". First error: {request_error_sentence(self.summary['errors'][0])}."
        self.message.setText(done)
        if store_error:
            self.notify.emit("error", f"The load test ran but was not saved: {store_error}")
        elif self.run_id is not None:
            self.run_stored.emit(self.run_id)

    def _on_failed(self, message: str) -> None:
        self.start_button.setEnabled(True)
        self.message.setText(message)
        self.notify.emit("error", f"Load test of {self.entry.name} failed: {message}")

    def shutdown(self) -> None:
        """Stop waiting for a running test (it is bounded by its request count)."""
        self.runner.stop()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.runner.cancel()
        super().closeEvent(event)


def _load_task(spec, name: str, db):
    """A worker task: run_load on a helper thread, relaying its progress through yields."""

    def task(cancel: threading.Event):
        from monitor.loadgen import run_load, store_run

        def work(report):
            return run_load(spec, lambda done, total: report(
                Progress(done / total, f"{done} / {total} requests")))

        # A cancel leaves the load to end by itself (it is bounded by its request count); a
        # failure is raised here and the runner turns it into a sentence.
        result = yield from relay(work, "servescope-loadtest", join_on_close=False)
        run_id, store_error = None, None
        if db is not None:
            try:
                run_id = store_run(db, result, name=name)
            except Exception as exc:  # a locked or full database: the results still show
                store_error = str(exc)
        return result.summary, run_id, store_error

    return task


def _spin(lo: int, hi: int, value: int) -> QSpinBox:
    return QSpinBox(minimum=lo, maximum=hi, value=value)
