"""The Servers pane: add, edit and remove remote servers, test them, load-test them."""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.navigation import PageMixin, make_actions, on_click
from app.panes.monitor.loadtest import LoadTestDialog
from app.panes.monitor.service import MonitorService, test_connection
from app.panes.monitor.state import API_METRICS, API_PROMETHEUS, ServerEntry, fmt
from app.workers import TaskRunner
from monitor.normalize import exposes
from monitor.ssh import SSH_REASONS, is_ssh_url, parse_target, ssh_url
from monitor.types import REASONS

COLUMNS = ("Name", "URL", "Kind", "Exposes", "Status", "Why", "Scrapes", "Last error", "$/hour",
           "Token", "Quality canary")
STATUS_REFRESH_MS = 1000


class ServerDialog(QDialog):
    """Name, URL (http(s), or ssh:// with the port the server listens on over there), how it is
    read (its /metrics or a Prometheus server's API, with a job), token reference and price of
    one server."""

    def __init__(self, entry: ServerEntry | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Edit server" if entry else "Add server")
        self.name = QLineEdit(entry.name if entry else "")
        self.url = QLineEdit(entry.url if entry else "http://127.0.0.1:8000")
        self.url.setToolTip("http(s)://host:port, or ssh://[user@]host[:port] (a host of your "
                            "~/.ssh/config works) for a server on that box's loopback")
        self.remote_port = QSpinBox(minimum=0, maximum=65535)
        self.remote_port.setSpecialValueText("—")
        self.remote_port.setToolTip("For ssh:// URLs: the port the server listens on, on the "
                                    "remote box (forwarded through SSH)")
        if entry and is_ssh_url(entry.url):
            target = parse_target(entry.url)
            if target.url == ssh_url(target.box, target.remote_port) and target.gpus:
                self.url.setText(target.box)  # a plain one: the box here, the port below
                self.remote_port.setValue(target.remote_port)
        self.url.textChanged.connect(self._on_url)
        self._on_url()
        self.token_ref = QLineEdit(entry.token_ref if entry else "")
        self.token_ref.setPlaceholderText("env:VARIABLE holding the bearer token (optional)")
        self.price = QDoubleSpinBox(decimals=3, maximum=100_000, prefix="$ ", suffix=" /h")
        self.price.setSpecialValueText("not set")
        if entry and entry.dollars_per_hour is not None:
            self.price.setValue(entry.dollars_per_hour)
        self.api = QComboBox()
        self.api.addItem("Its /metrics (vLLM, SGLang, TGI, llama.cpp, Triton, DCGM, Ollama…)",
                         API_METRICS)
        self.api.addItem("A Prometheus server's HTTP API (a fleet; backfills 15 min)",
                         API_PROMETHEUS)
        self.api.setCurrentIndex(max(0, self.api.findData(entry.api if entry else API_METRICS)))
        self.job = QLineEdit(entry.job if entry else "")
        self.job.setPlaceholderText("Prometheus job to read (optional; all vLLM jobs if empty)")
        self.canary = QSpinBox(minimum=0, maximum=24 * 60, suffix=" min")
        self.canary.setSpecialValueText("off")
        self.canary.setToolTip("Quality canary: score a bundled held-out text on this server "
                               "this often (its prompt log-probabilities), chart the "
                               "perplexity and alert when it drifts from its first scores "
                               "(kept across sessions)")
        if entry and entry.canary_every_s:
            self.canary.setValue(max(1, round(entry.canary_every_s / 60)))
        self.canary_decode = QSpinBox(minimum=0, maximum=1_000_000, prefix="from token ")
        self.canary_decode.setSpecialValueText("no: one prefill (any server)")
        self.canary_decode.setToolTip(
            "servescope serve only: prefill the text up to this token and decode the rest one "
            "token at a time through the server's KV cache, so the score shows what KV-cache "
            "eviction or quantization costs a long reply (a prefill never does); decoding "
            "takes a step per token")
        if entry and entry.canary_decode_from:
            self.canary_decode.setValue(entry.canary_decode_from)
        self.api.currentIndexChanged.connect(self._on_api)
        self._on_api()
        form = QFormLayout(self)
        for label, widget in (("Name", self.name), ("URL", self.url),
                              ("Remote port", self.remote_port), ("Reads", self.api),
                              ("Job", self.job), ("Token", self.token_ref),
                              ("Price", self.price), ("Quality canary", self.canary),
                              ("Canary decodes", self.canary_decode)):
            form.addRow(label, widget)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def _on_api(self) -> None:
        self.job.setEnabled(self.api.currentData() == API_PROMETHEUS)

    def _on_url(self) -> None:
        self.remote_port.setEnabled(is_ssh_url(self.url.text()))

    def _url(self) -> str:
        url = self.url.text().strip()
        if not is_ssh_url(url):
            return url
        return ssh_url(url, self.remote_port.value() or None)

    def entry(self) -> ServerEntry:
        """The entry the fields describe; ValueError names what is wrong."""
        price = self.price.value()
        api = self.api.currentData()
        minutes, decode_from = self.canary.value(), self.canary_decode.value()
        return ServerEntry(self.name.text().strip(), self._url(),
                           self.token_ref.text().strip(), price if price > 0 else None, api,
                           self.job.text().strip() if api == API_PROMETHEUS else "",
                           60.0 * minutes if minutes else None,
                           decode_from or None)


class ServersPane(PageMixin, QWidget):
    """The remote servers the monitor watches, with their kind, status and last error."""

    pane_id = "servers"
    title = "Servers"
    notify = Signal(str, str)
    run_stored = Signal(int)

    def __init__(self, service: MonitorService, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.service = service
        service.acquire()
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.tested: dict[str, object] = {}  # name -> SourceStatus of the last "test connection"
        self.tester = TaskRunner(self)
        self.tester.succeeded.connect(self._on_tested)
        self.tester.failed.connect(lambda m: self.notify.emit("error", m))
        self.dialogs: list[LoadTestDialog] = []
        self._timer = QTimer(self, interval=STATUS_REFRESH_MS)
        self._timer.timeout.connect(self.refresh)
        self._actions = self._build()

    def _build(self) -> list[QAction]:
        buttons = QHBoxLayout()
        actions = make_actions(self, (
            ("Add server…", "Ctrl+Shift+N", self.add_server),
            ("Edit server…", "Ctrl+Alt+I", self.edit_server),
            ("Remove server", "Ctrl+Shift+Del", self.remove_server),
            ("Test connection", "Ctrl+Shift+J", self.test_selected),
            ("Load test…", "Ctrl+Shift+G", self.open_load_test),
            ("Score canary now", "Ctrl+Alt+N", self.score_canary_now),
        ))
        for action in actions:
            button = QPushButton(action.text().rstrip("…"))
            on_click(button.clicked, action.trigger)
            buttons.addWidget(button)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addLayout(buttons)
        layout.addWidget(self.table, 1)
        return actions

    # ---- Pane protocol
    def start(self) -> None:
        """Start the shared monitor and show the saved servers."""
        self.service.start()
        self._timer.start()
        self.refresh()

    def save(self) -> None:
        """Servers are saved in the database as they change."""

    def shutdown(self) -> None:
        """Stop the status timer, tests and load tests; the last pane stops the hub."""
        self._timer.stop()
        self.tester.stop()
        for dialog in self.dialogs:
            dialog.shutdown()
        self.service.release()

    # ---- actions
    def add_server(self, entry: ServerEntry | None = None) -> bool:
        """Add ``entry``, or ask for one; False when nothing was added."""
        if entry is None:
            entry = self._ask(None)
        if entry is None:
            return False
        return self._apply(entry, None)

    def edit_server(self, entry: ServerEntry | None = None) -> bool:
        """Change the selected server (to ``entry`` when given, else ask)."""
        old = self.selected()
        if old is None:
            return False
        entry = entry or self._ask(self.service.servers[old])
        return entry is not None and self._apply(entry, old)

    def remove_server(self) -> None:
        """Stop watching the selected server; its recorded data stays in History."""
        name = self.selected()
        if name is not None:
            self.service.remove_server(name)
            self.tested.pop(name, None)
            self.refresh()

    def test_selected(self) -> None:
        """Scrape the selected server once now and show its kind and status."""
        name = self.selected()
        if name is None or self.tester.is_running():
            return
        entry = self.service.servers[name]

        def task(_cancel):
            return (name, test_connection(entry))
            yield  # a generator task, though one scrape has no progress to report

        self.tester.start(task)

    def score_canary_now(self) -> None:
        """Score the selected server's quality canary now (it otherwise scores on its
        schedule); the Servers table's canary column shows the new score when it is in."""
        name = self.selected()
        if name is None:
            self.notify.emit("warning", "Select a server whose quality canary to score.")
            return
        problem = self.service.score_canary_now(name)
        if problem is not None:
            self.notify.emit("warning", problem)
        else:
            self.notify.emit("info", f"Scoring {name}'s quality canary now; its perplexity "
                                     "appears in the Quality canary column when it is in.")

    def open_load_test(self) -> LoadTestDialog | None:
        """Open the load-test dialog for the selected server."""
        name = self.selected()
        if name is None:
            return None
        if is_ssh_url(self.service.servers[name].url):
            self.notify.emit("error", f"{name} is reached through SSH, and load tests need an "
                                      "HTTP URL: forward its port with ssh -L and load-test "
                                      "http://127.0.0.1:PORT.")
            return None
        dialog = LoadTestDialog(self.service.servers[name], self.service, self)
        dialog.notify.connect(self.notify)
        dialog.run_stored.connect(self.run_stored)
        self.dialogs.append(dialog)
        dialog.show()
        return dialog

    def selected(self) -> str | None:
        """The selected server's name."""
        rows = self.table.selectionModel().selectedRows()
        return self.table.item(rows[0].row(), 0).text() if rows else None

    def select(self, name: str) -> None:
        """Select the row of ``name``."""
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).text() == name:
                self.table.selectRow(row)

    # ---- internals
    def _ask(self, entry: ServerEntry | None) -> ServerEntry | None:
        dialog = ServerDialog(entry, self)
        while dialog.exec() == QDialog.DialogCode.Accepted:
            try:
                return dialog.entry()
            except ValueError as exc:
                self.notify.emit("error", str(exc))
        return None

    def _apply(self, entry: ServerEntry, replacing: str | None) -> bool:
        try:
            self.service.add_server(entry, replacing)
        except ValueError as exc:
            self.notify.emit("error", str(exc))
            return False
        self.refresh()
        self.select(entry.name)
        return True

    def _on_tested(self, result: tuple) -> None:
        name, status = result
        self.tested[name] = status
        self.refresh()
        if status.state == "up":
            self.notify.emit("info", f"{name} is up: a {status.kind} server ({status.message}).")
        else:
            self.notify.emit("error", f"{name} is down: {status.last_error}")

    def rows(self) -> list[list[str]]:
        """The table's cells, one row per server."""
        statuses = self.service.statuses()
        out = []
        for name, entry in sorted(self.service.servers.items()):
            tested = self.tested.get(name)
            status = statuses.get(name)
            if status is None or (status.state == "unknown" and tested is not None):
                status = tested  # the hub has not polled it yet; the test has
            kind = status.kind if status else "unknown"
            if kind in ("unknown", "prometheus") and tested is not None:
                kind = tested.kind  # an idle hub scrape may not show labelled metrics yet
            exposed = exposes(kind, bool(status and status.api_only)) if status else "—"
            out.append([name, entry.url, kind, exposed, status.state if status else "unknown",
                        _why(status), _scrapes(status),
                        (status.last_error or "") if status else "",
                        fmt(entry.dollars_per_hour), entry.token_ref or "—",
                        _canary(entry, statuses.get(entry.canary_name), self.service)])
        return out

    def refresh(self) -> None:
        """Redraw the table from the service, keeping the selection."""
        selected = self.selected()
        rows = self.rows()
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                item = self.table.item(r, c)
                if item is None:
                    self.table.setItem(r, c, QTableWidgetItem(text))
                elif item.text() != text:
                    item.setText(text)
        if selected is not None:
            self.select(selected)


def _canary(entry: ServerEntry, status, service: MonitorService) -> str:
    """How often the server's quality canary scores it, and its last perplexity and drift, or
    why it could not score."""
    if entry.canary_every_s is None:
        return "off"
    every = f"every {entry.canary_every_s / 60:g} min"
    if entry.canary_decode_from is not None:
        every += f", decoded from token {entry.canary_decode_from}"
    if status is None or status.state == "unknown":
        return f"{every}: scoring…"
    if status.state != "up":
        return f"{every}: {status.message or status.last_error or 'not scored'}"
    hub, name = service.hub, entry.canary_name
    _, ppl = hub.series(f"{name}/canary_perplexity") if hub is not None else ((), ())
    if not len(ppl):
        return f"{every}: scoring…"
    _, drift = hub.series(f"{name}/canary_drift")
    shown = f"{every}: perplexity {ppl[-1]:.3g}"
    return shown + (f" ({(drift[-1] - 1) * 100:+.1f}% vs baseline)" if len(drift) else "")


def _why(status) -> str:
    """The reason code of a down source, with what it means and since when (live, as the hub's
    scrape threads update it)."""
    if status is None or not getattr(status, "reason", None):
        return ""
    meaning = REASONS.get(status.reason) or SSH_REASONS.get(status.reason, "")
    since = ""
    if status.since:
        since = f" since {time.strftime('%H:%M:%S', time.localtime(status.since))}"
    return f"{status.reason}: {meaning}{since}" if meaning else f"{status.reason}{since}"


def _scrapes(status) -> str:
    """Scrapes that worked and failed, and NaN/±Inf values skipped (they cannot be stored)."""
    if status is None or not getattr(status, "scrapes", 0):
        return ""
    text = f"{status.scrapes - status.failed_scrapes} ok, {status.failed_scrapes} failed"
    if status.non_finite_total:
        text += f", {status.non_finite_total} NaN/Inf skipped"
    return text
