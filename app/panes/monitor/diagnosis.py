"""The Monitor pane's Diagnosis view: the current verdicts, their evidence and advice, history."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

from app.navigation import make_actions, on_click
from app.panes.monitor.service import MonitorService
from app.panes.monitor.tables import fill_table, read_only_table
from app.workers import TaskRunner

# (label, seconds) of the span judged, ending now.
SPANS = (("1 min", 60.0), ("5 min", 300.0), ("15 min", 900.0), ("1 hour", 3600.0))
DEFAULT_SPAN_S = 300.0
AUTO_MS = 15_000  # re-judged this often while the view is shown
CURRENT_COLUMNS = ("Cause", "Source", "GPU", "Kind", "From", "To")
HISTORY_COLUMNS = ("Cause", "Source", "GPU", "From", "To", "Last judged")


def clock(ts: float, date: bool = False) -> str:
    """A timestamp as local time ("16:02:11", or with the date)."""
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S")


def current_rows(verdicts: list[dict]) -> list[list[str]]:
    """The current verdicts' table rows."""
    return [[v["title"], v["source"], v["gpu"] or "—", v["kind"], clock(v["start"]),
             clock(v["end"])] for v in verdicts]


def history_rows(rows: list[dict]) -> list[list[str]]:
    """The stored verdicts' table rows (storage.queries.list_verdicts)."""
    return [[r["title"], r["source"], r["gpu"] or "—", clock(r["start"], True),
             clock(r["end"], True), clock(r["evaluated"], True)] for r in rows]


def details_text(verdict: dict) -> str:
    """A verdict's evidence, one sentence a line, then what to try."""
    from monitor.diagnosis import Evidence

    lines = [verdict["title"], ""]
    lines += [f"• {Evidence(**e).sentence()}" for e in verdict["evidence"]]
    lines += ["", f"Try: {verdict['advice']}"]
    return "\n".join(lines)


def diagnose_task(service: MonitorService, span_s: float):
    """A task judging the last ``span_s`` seconds: the database's series where it is open
    (what `servescope record` stores too), else the hub's live buffers; verdicts stored."""
    import time

    db, hub = service.db, service.hub

    def task(_cancel):
        from monitor.diagnosis import HubSeries, StoredSeries, evaluate
        from storage.queries import list_verdicts, save_verdicts

        end = time.time()
        view = StoredSeries(db) if db is not None else HubSeries(hub)
        result = evaluate(view, end - span_s, end)
        verdicts = [v.to_dict() for v in result.verdicts]
        history = []
        if db is not None:
            save_verdicts(db, verdicts, end)
            history = list_verdicts(db)
        return {"verdicts": verdicts, "summary": result.summary(), "history": history}
        yield  # a few queries: no progress to report

    return task


class DiagnosisView(QWidget):
    """Names the bottleneck or cause in the monitored series (monitor.diagnosis), every
    AUTO_MS while shown and on demand; lists the verdicts' history and exports them."""

    notify = Signal(str, str)
    diagnosed = Signal()

    def __init__(self, service: MonitorService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self.verdicts: list[dict] = []
        self.history: list[dict] = []
        self.span_combo = QComboBox()
        for label, seconds in SPANS:
            self.span_combo.addItem(label, seconds)
        self.span_combo.setCurrentIndex(self.span_combo.findData(DEFAULT_SPAN_S))
        self.summary = QLabel("Not judged yet.")
        self.summary.setWordWrap(True)
        self.summary.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.current_table = read_only_table(CURRENT_COLUMNS, single=True)
        self.history_table = read_only_table(HISTORY_COLUMNS, single=True)
        self.details = QTextEdit(readOnly=True)
        self.details.setPlaceholderText("Select a verdict to read its evidence and what to try.")
        self.runner = TaskRunner(self)
        self.runner.succeeded.connect(self._on_diagnosed)
        self.runner.failed.connect(self._on_failed)
        self._timer = QTimer(self, interval=AUTO_MS)
        self._timer.timeout.connect(self._auto)
        self.actions = self._build()
        self.current_table.itemSelectionChanged.connect(self._show_selected)
        self.history_table.itemSelectionChanged.connect(self._show_selected_history)

    def _build(self) -> list[QAction]:
        actions = make_actions(self, (
            ("Diagnose now", "Ctrl+Alt+D", self.diagnose),
            ("Export verdicts as CSV…", "Ctrl+Alt+V", lambda: self.export("csv")),
            ("Export verdicts as JSON…", "Ctrl+Alt+J", lambda: self.export("json")),
        ))
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Judge the last"))
        bar.addWidget(self.span_combo)
        for action in actions:
            button = QPushButton(action.text().rstrip("…"))
            on_click(button.clicked, action.trigger)
            bar.addWidget(button)
        bar.addStretch(1)
        lower = QSplitter()
        lower.addWidget(self.details)
        history = QWidget()
        history_layout = QVBoxLayout(history)
        history_layout.setContentsMargins(0, 0, 0, 0)
        history_layout.addWidget(QLabel("History (stored verdicts, newest first)"))
        history_layout.addWidget(self.history_table)
        lower.addWidget(history)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.addLayout(bar)
        layout.addWidget(self.summary)
        layout.addWidget(QLabel("Current verdicts"))
        layout.addWidget(self.current_table, 1)
        layout.addWidget(lower, 1)
        return actions

    def start(self) -> None:
        self._timer.start()

    def shutdown(self) -> None:
        self._timer.stop()
        self.runner.stop()

    def span_s(self) -> float:
        """The chosen span in seconds."""
        return float(self.span_combo.currentData())

    def diagnose(self) -> None:
        """Judge the last span now, in the background."""
        self.service.start()  # from the menu before the Monitor pane was shown; once only
        if not self.runner.is_running():
            if self._timer.isActive():  # the next automatic judgment AUTO_MS after this one
                self._timer.start()
            self.summary.setText("Judging the live series only: the database is still "
                                 "opening…" if self.service.db_opening else "Judging…")
            self.runner.start(diagnose_task(self.service, self.span_s()))

    def _auto(self) -> None:
        if self.isVisible():
            self.diagnose()

    def _on_diagnosed(self, result: dict) -> None:
        if self._timer.isActive():
            self._timer.start()
        self.verdicts = result["verdicts"]
        if self.service.db is not None:
            self.history = result["history"]
        else:  # not stored: what was judged this session is all the history there is
            self.history = [dict(v, evaluated=v["end"]) for v in self.verdicts] + self.history
        stored = "" if self.service.db is not None else " (no database: not stored)"
        self.summary.setText(result["summary"] + stored)
        fill_table(self.current_table, current_rows(self.verdicts))
        fill_table(self.history_table, history_rows(self.history))
        if self.verdicts:
            self.current_table.selectRow(0)
        else:
            self.details.clear()
        self.diagnosed.emit()

    def _on_failed(self, message: str) -> None:
        self.summary.setText("The diagnosis failed; see the message.")
        self.notify.emit("error", message)

    def _show_selected(self) -> None:
        rows = self.current_table.selectionModel().selectedRows()
        if rows and rows[0].row() < len(self.verdicts):
            self.details.setPlainText(details_text(self.verdicts[rows[0].row()]))

    def _show_selected_history(self) -> None:
        rows = self.history_table.selectionModel().selectedRows()
        if rows and rows[0].row() < len(self.history):
            self.details.setPlainText(details_text(self.history[rows[0].row()]))

    def export(self, fmt: str) -> None:
        """Write the stored verdicts (or, without a database, this session's) as CSV or JSON."""
        from monitor.diagnosis import verdicts_csv, verdicts_json

        rows = self.history or self.verdicts
        if not rows:
            self.notify.emit("warning", "No verdicts to export yet; press Diagnose now first.")
            return
        pattern = "CSV file (*.csv)" if fmt == "csv" else "JSON file (*.json)"
        path, _ = QFileDialog.getSaveFileName(self, "Export verdicts", f"verdicts.{fmt}",
                                              pattern)
        if not path:
            return
        text = verdicts_csv(rows) if fmt == "csv" else verdicts_json(rows)
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as exc:
            self.notify.emit("error", f"Could not write {path}: {exc.strerror or exc}.")
            return
        self.notify.emit("info", f"Saved {len(rows)} verdicts to {path}.")
