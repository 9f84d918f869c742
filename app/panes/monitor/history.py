"""The History pane: stored runs, two compared side by side, CSV export."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.navigation import PageMixin, make_actions, on_click
from app.panes.monitor.service import MonitorService
from app.panes.monitor.state import fmt, table_csv
from app.panes.monitor.tables import fill_table, read_only_table
from app.workers import TaskRunner

RUN_COLUMNS = ("Id", "Kind", "Name", "Started", "Completed", "Failed", "TTFT p50 ms",
               "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "Output tok/s")
# (label, path into run_summary's result) for the side-by-side comparison.
COMPARE_ROWS = (
    [("Kind", ("kind",)), ("Name", ("name",)), ("Completed", ("completed",)),
     ("Failed", ("failed",)), ("Requests/s", ("summary", "request_throughput")),
     ("Output tokens/s", ("summary", "output_tokens_per_s"))]
    + [(f"{m.upper()} {p} (ms)", ("requests", f"{m}_ms", p))
       for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p95", "p99", "mean")])


def _dig(data: dict, path: tuple[str, ...]) -> object:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def run_row(run: dict) -> list[str]:
    """One runs-table row from a list_runs entry (its stored summary)."""
    s = run.get("summary") or {}
    started = dt.datetime.fromtimestamp(run["started_ms"] / 1000).strftime("%Y-%m-%d %H:%M:%S")
    return [str(run["id"]), run["kind"], run["name"], started, fmt(s.get("completed")),
            fmt(s.get("failed")), fmt(_dig(s, ("ttft_ms", "p50"))),
            fmt(_dig(s, ("ttft_ms", "p99"))), fmt(_dig(s, ("tpot_ms", "p50"))),
            fmt(_dig(s, ("tpot_ms", "p99"))), fmt(s.get("output_tokens_per_s"))]


def benchmark_name(result: dict) -> str:
    """"SmolLM2 on cpu · float weights · spec off", the name a benchmark run goes by."""
    from app.panes.engine.state import configuration_text

    name = f"{result.get('model', 'engine')} on {result.get('device', '?')}"
    config = result.get("configuration")
    return f"{name} · {configuration_text(config)}" if config else name


def benchmark_config(result: dict) -> dict:
    """The stored configuration of a benchmark run: engine options, sizes and the machine."""
    return {"engine": result.get("configuration") or {}, "device": result.get("device"),
            "dtype": result.get("dtype"), "sizes": result.get("config"),
            "machine": result.get("machine"), "quick": result.get("quick")}


def benchmark_summary(result: dict) -> dict:
    """A benchmark's figures in the shape load-test summaries have (History's columns)."""
    return {"ttft_ms": {"p50": result.get("ttft_ms")},
            "output_tokens_per_s": result.get("decode_tokens_per_s"),
            "prefill_tokens_per_s": result.get("prefill_tokens_per_s"),
            "throughput_tokens_per_s": result.get("throughput_tokens_per_s")}


def compare_rows(a: dict, b: dict) -> list[list[str]]:
    """Metric, run A, run B and B - A for two run_summary results."""
    rows = []
    for label, path in COMPARE_ROWS:
        va, vb = _dig(a, path), _dig(b, path)
        numeric = isinstance(va, int | float) and isinstance(vb, int | float)
        rows.append([label, fmt(va), fmt(vb), fmt(float(vb) - float(va)) if numeric else ""])
    return rows


class HistoryPane(PageMixin, QWidget):
    """Past runs from the database; select two to compare them."""

    pane_id = "history"
    title = "History"
    notify = Signal(str, str)
    loaded = Signal()
    compared = Signal()
    estimated = Signal()

    def __init__(self, service: MonitorService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        service.acquire()
        self.runs: list[dict] = []
        self.comparison: list[list[str]] = []
        self.runs_table = read_only_table(RUN_COLUMNS)
        self.runs_table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.compare_table = read_only_table(("Metric", "Run A", "Run B", "B − A"))
        self.status = QLabel("")
        self.loader = TaskRunner(self)
        self.loader.succeeded.connect(self._on_loaded)
        self.loader.failed.connect(lambda m: self.notify.emit("error", m))
        self.saver = TaskRunner(self)
        self.saver.succeeded.connect(lambda _run_id: self.reload())
        self.saver.failed.connect(lambda m: self.notify.emit("error", m))
        self.comparer = TaskRunner(self)
        self.comparer.succeeded.connect(self._on_compared)
        self.comparer.failed.connect(lambda m: self.notify.emit("error", m))
        self.estimates: list[list[str]] = []
        self.estimator = TaskRunner(self)
        self.estimator.succeeded.connect(self._on_estimated)
        self.estimator.failed.connect(lambda m: self.notify.emit("error", m))
        self._actions = self._build()

    def _build(self) -> list[QAction]:
        bar = QHBoxLayout()
        actions = make_actions(self, (
            ("Refresh runs", "F5", self.reload),
            ("Compare selected runs", "Ctrl+Shift+M", self.compare),
            ("Client vs server estimates", "Ctrl+Alt+E", self.compare_with_server),
            ("Export runs as CSV…", "Ctrl+Alt+X", self.export_csv),
        ))
        for action in actions:
            button = QPushButton(action.text().rstrip("…"))
            on_click(button.clicked, action.trigger)
            bar.addWidget(button)
        bar.addStretch(1)
        bar.addWidget(self.status)
        splitter = QSplitter()
        splitter.addWidget(self.runs_table)
        splitter.addWidget(self.compare_table)
        splitter.setSizes([700, 400])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addLayout(bar)
        layout.addWidget(splitter, 1)
        return actions

    # ---- Pane protocol
    def start(self) -> None:
        """Start the shared monitor and list the stored runs."""
        self.service.start()
        self.reload()

    def save(self) -> None:
        """Nothing to persist: the runs live in the database."""

    def shutdown(self) -> None:
        """Stop the queries; the last pane stops the hub."""
        self.loader.stop()
        self.saver.stop()
        self.comparer.stop()
        self.estimator.stop()
        self.service.release()

    # ---- actions
    def reload(self) -> None:
        """Read the runs list in the background."""
        db = self.service.db
        if db is None:
            self.status.setText("opening database…" if self.service.db_opening else
                                "no database: " + (self.service.db_error or "not opened yet"))
            return

        def task(_cancel):
            from storage.queries import list_runs

            return list_runs(db)
            yield  # one query: no progress to report

        self.loader.start(task)

    def compare(self, ids: tuple[int, int] | None = None) -> None:
        """Compare two runs (the two selected when ``ids`` is not given)."""
        if ids is None:
            rows = sorted({i.row() for i in self.runs_table.selectionModel().selectedRows()})
            if len(rows) != 2:
                self.notify.emit("warning", "Select exactly two runs to compare.")
                return
            ids = (self.runs[rows[0]]["id"], self.runs[rows[1]]["id"])
        db = self.service.db

        def task(_cancel):
            from storage.queries import run_summary

            return run_summary(db, ids[0]), run_summary(db, ids[1])
            yield  # two queries: no progress to report

        self.comparer.start(task)

    def compare_with_server(self, run_id: int | None = None) -> None:
        """The selected load test's exact percentiles beside the server's histogram estimates
        for the same minutes, with the bucket each estimate lies in."""
        if run_id is None:
            rows = {i.row() for i in self.runs_table.selectionModel().selectedRows()}
            if len(rows) != 1:
                self.notify.emit("warning", "Select one load test to compare with the server's "
                                            "own estimates.")
                return
            run_id = self.runs[rows.pop()]["id"]
        run = next(r for r in self.runs if r["id"] == run_id)
        db = self.service.db

        def task(_cancel):
            from app.panes.monitor.estimates import estimate_rows

            return run, *estimate_rows(db, run)
            yield  # a few queries: no progress to report

        self.estimator.start(task)

    def add_benchmark(self, result: dict) -> None:
        """Store an engine benchmark as a run, beside the load tests, and list it."""
        db = self.service.db
        if db is None:
            return  # no database: the benchmark stays in the engine's own results file

        def task(_cancel):
            from storage.queries import save_run

            finished = float(result.get("finished_at") or time.time())
            return save_run(db, "bench", benchmark_name(result), benchmark_config(result),
                            benchmark_summary(result), finished, finished)
            yield  # one insert: no progress to report

        self.saver.start(task)

    def export_csv(self, path: str | None = None) -> None:
        """Write the runs (and the comparison, if any) as CSV files."""
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Export runs", "runs.csv",
                                                  "CSV file (*.csv)")
        if not path:
            return
        try:
            Path(path).write_text(table_csv(list(RUN_COLUMNS), map(run_row, self.runs)),
                                  encoding="utf-8")
            if self.comparison:
                Path(path).with_suffix(".compare.csv").write_text(
                    table_csv(["metric", "run_a", "run_b", "b_minus_a"], self.comparison),
                    encoding="utf-8")
        except OSError as exc:
            self.notify.emit("error", f"Could not write {path}: {exc.strerror or exc}.")

    # ---- results
    def _on_loaded(self, runs: list[dict]) -> None:
        self.runs = runs
        fill_table(self.runs_table, [run_row(r) for r in runs])
        self.status.setText(f"{len(runs)} run(s)")
        self.loaded.emit()

    def _on_estimated(self, result: tuple[dict, str | None, list[list[str]]]) -> None:
        from app.panes.monitor.estimates import COLUMNS, SLACK_S, window_note

        run, source, rows = result
        self.estimates = rows
        if not rows:
            if time.time() < (run.get("finished_ms") or 0) / 1000 + SLACK_S:
                self.notify.emit("info", f"The server's estimates for run {run['id']} are not "
                                         "stored yet; try again in a few seconds.")
            else:
                self.notify.emit("warning", f"No server estimates are stored for run "
                                 f"{run['id']}'s minutes: watch the server (Servers pane, or "
                                 "servescope record) while the load test runs.")
            return
        self.compare_table.setColumnCount(len(COLUMNS))
        self.compare_table.setHorizontalHeaderLabels(
            [f"Run {run['id']} vs {source}", *COLUMNS[1:]])
        fill_table(self.compare_table, rows)
        note = window_note(run)
        if note:
            self.notify.emit("info", note)
        self.estimated.emit()

    def _on_compared(self, pair: tuple[dict, dict]) -> None:
        a, b = pair
        self.comparison = compare_rows(a, b)
        self.compare_table.setColumnCount(4)
        self.compare_table.setHorizontalHeaderLabels(
            ["Metric", f"Run {a['id']}", f"Run {b['id']}", "B − A"])
        fill_table(self.compare_table, self.comparison)
        self.compared.emit()
