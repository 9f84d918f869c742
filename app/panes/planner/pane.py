"""The Planner pane: workload form, cancellable search, ranking, charts, scenarios and report."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QFont
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.navigation import PageMixin, make_actions, on_click
from app.panes.planner.charts import ChartView
from app.panes.planner.figures import ChartSpec, all_charts
from app.panes.planner.form import WorkloadForm
from app.panes.planner.model import PlannerModel, calibration_text  # noqa: F401 (re-export)
from app.panes.planner.report import command_lines, manifest_lines, trust_note
from app.panes.planner.report_writer import write_report
from app.panes.planner.results import PlanTable, ScenarioTable, ValidationTable, WhatIfPanel
from app.panes.planner.state import (
    Outcome,
    load_form,
    plan_label,
    save_form,
)
from app.panes.planner.store import PlannerStore
from app.panes.planner.tasks import (
    USER_ERRORS,
    Failure,
    WorkstationBench,
    detail_task,
    run_here_task,
    search_task,
    user_message,
    workstation_task,
)
from app.plan_run import DEMO_HF_ID, MEASURED_HERE
from app.workers import Progress, TaskRunner
from planner.catalog import Model, load_catalog
from planner.evaluate import Evaluation
from planner.export import (
    NotServable,
    command_or_reason,
    kubernetes_yaml,
    servescope_serve_args,
    sglang_command,
    vllm_command,
)
from planner.measured import CalibrationReport, calibrate_measured, load_engine_results
from planner.search import Plan

# Edits arrive in bursts (a spin box held down); wait this long for the burst to end.
DEBOUNCE_MS = 300
PRESENTATION_SCALE = 1.8
CHART_KEYS = ("pareto", "ttft", "tpot", "day_cost", "memory")


class PlannerPane(PageMixin, QWidget):
    """Sizes a deployment for a workload and presents it: ranking, charts, what-ifs, report."""

    pane_id = "planner"
    title = "Planner"
    notify = Signal(str, str)
    outcome_ready = Signal(object)
    detail_ready = Signal(object)

    def __init__(self, form_folder: Path | None = None, parent: QWidget | None = None,
                 db_url: str | None = None) -> None:
        super().__init__(parent)
        self._form_folder = form_folder
        self.store = PlannerStore(db_url)
        self._db_reported = False
        self.model = PlannerModel()
        self.model.observe(self._on_model)
        self._pending = False
        self._base_font = QFont(self.font())
        catalog, self._catalog_error = None, ""
        try:
            catalog = load_catalog()
        except USER_ERRORS as exc:
            self._catalog_error = user_message(exc)
        self.form = WorkloadForm(catalog)
        self.form.set_state(load_form(form_folder))
        self.runner = TaskRunner(self)
        self.detail_runner = TaskRunner(self)
        self.bench_runner = TaskRunner(self)
        self.device_runner = TaskRunner(self)
        self.run_here_runner = TaskRunner(self)
        # Reads the monitor's database, which can hold days of samples: off the GUI thread.
        self.acceptance_runner = TaskRunner(self)
        self.no_gpu_reason = ""  # set once the device probe finds no CUDA GPU
        self._debounce = QTimer(self, singleShot=True, interval=DEBOUNCE_MS)
        self._build()
        self._connect()
        self._actions = self._make_actions()

    # ---- construction
    def _build(self) -> None:
        self.status = QLabel("Fill in the workload; the ranking follows every change.")
        # Shown only while work runs: a finished bar was a blank blue strip that said nothing.
        self.progress = QProgressBar(maximum=1000, textVisible=False, maximumWidth=180,
                                     visible=False)
        self.cancel_button = QPushButton("Cancel", enabled=False)
        self.scenario_button = QPushButton("Keep as scenario")
        self.save_scenarios_button = QPushButton("Save scenarios")
        self.calibrate_button = QPushButton("Calibrate…")
        self.workstation_button = QPushButton("Calibrate here")
        self.workstation_button.setToolTip("Benchmark the demo model on this machine's engine "
                                           "and calibrate the planner from the result")
        self.run_here_button = QPushButton("Run here", enabled=False)
        self.run_here_button.setToolTip(RUN_HERE_NEEDS)
        self.run_here_server = QComboBox()
        for label, engine in RUN_HERE_SERVERS:
            self.run_here_server.addItem(label, engine)
        self.run_here_server.setAccessibleName("Server to run the plan with")
        self.run_here_server.setToolTip("Which server \"Run here\" starts: real vLLM with the "
                                        "plan's vllm serve flags where it is installed "
                                        "(SERVESCOPE_VLLM_PYTHON, or vllm on PATH), or "
                                        "servescope serve with the same settings")
        self.report_button = QPushButton("Export report…")
        self.present_button = QPushButton("Presentation", checkable=True)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        # Two rows: progress beside the status, actions below, so the pane fits a laptop.
        bar = QVBoxLayout()
        top, actions = QHBoxLayout(), QHBoxLayout()
        top.addWidget(self.status, 1)
        top.addWidget(self.progress)
        top.addWidget(self.cancel_button)
        for w in (self.scenario_button, self.save_scenarios_button, self.calibrate_button,
                  self.workstation_button, self.report_button, self.present_button):
            actions.addWidget(w)
        actions.addStretch(1)
        bar.addLayout(top)
        bar.addLayout(actions)
        # Why the last search found no plan (the constraint that binds); hidden after a success.
        self.plan_banner = QLabel("")
        self.plan_banner.setObjectName("planner-no-plan")
        self.plan_banner.setStyleSheet("QLabel#planner-no-plan { background: #5c1f1f; "
                                       "color: white; padding: 6px; "
                                       "border-left: 4px solid #e15759; }")
        self.plan_banner.setWordWrap(True)
        self.plan_banner.setVisible(False)
        self.plan_banner.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.recommendation = QLabel("")
        self.recommendation.setObjectName("planner-recommendation")
        self.recommendation.setWordWrap(True)
        self.recommendation.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.table = PlanTable()
        self.what_if = WhatIfPanel()
        self.charts = {key: ChartView(ChartSpec("")) for key in CHART_KEYS}
        grid = QGridLayout()
        for i, key in enumerate(CHART_KEYS):
            grid.addWidget(self.charts[key], i // 3, i % 3)
        grid.addWidget(self.what_if, 1, 2)
        chart_grid = QWidget()
        chart_grid.setLayout(grid)
        # Scrolls rather than forcing the whole window wider than a laptop screen.
        chart_page = QScrollArea(widgetResizable=True)
        chart_page.setWidget(chart_grid)
        self.scenario_table = ScenarioTable()
        self.deploy = QPlainTextEdit(readOnly=True)
        self.deploy.setFont(QFont("monospace"))
        self.deploy_page = self._deploy_page()
        self.tabs = QTabWidget()
        self.tabs.addTab(self.table, "Ranking")
        self.tabs.addTab(chart_page, "Charts")
        self.tabs.addTab(self.scenario_table, "Scenarios")
        self.tabs.addTab(self.deploy_page, "Deploy")
        self.validation_page = self._validation_page()
        self.tabs.addTab(self.validation_page, "Validation")
        self.tabs.currentChanged.connect(self._on_tab)
        right = QWidget()
        column = QVBoxLayout(right)
        column.setContentsMargins(0, 0, 0, 0)
        column.addLayout(bar)
        column.addWidget(self.plan_banner)
        column.addWidget(self.recommendation)
        column.addWidget(self.tabs, 1)
        self.form_scroll = QScrollArea(widgetResizable=True)
        self.form_scroll.setWidget(self.form)
        self.form_scroll.setMinimumWidth(300)
        self.form_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.splitter = QSplitter()
        self.splitter.addWidget(self.form_scroll)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([380, 1000])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(self.splitter)

    def _deploy_page(self) -> QWidget:
        self.copy_deploy_button = QPushButton("Copy", enabled=False)
        self.copy_deploy_button.setToolTip("Copy the commands and manifests to the clipboard")
        self.save_deploy_button = QPushButton("Save…", enabled=False)
        self.save_deploy_button.setToolTip("Save the commands as a shell script and the "
                                           "Kubernetes manifests beside it as YAML")
        on_click(self.copy_deploy_button.clicked, self.copy_deploy)
        on_click(self.save_deploy_button.clicked, lambda: self.save_deploy())
        row = QHBoxLayout()
        row.addWidget(self.copy_deploy_button)
        row.addWidget(self.save_deploy_button)
        # Beside the chosen plan's commands: run them here (the action row is full at 1,100 px).
        row.addWidget(self.run_here_button)
        row.addWidget(self.run_here_server)
        row.addStretch(1)
        page = QWidget()
        column = QVBoxLayout(page)
        column.setContentsMargins(0, 4, 0, 0)
        column.addLayout(row)
        column.addWidget(self.deploy, 1)
        return page

    def _connect(self) -> None:
        self.form.notify.connect(self.notify)
        self.form.changed.connect(self._debounce.start)
        # Turning speculation on reads what the monitor has measured since the pane started.
        self.form.speculative.toggled.connect(lambda on: on and self.refresh_acceptance())
        self._debounce.timeout.connect(self.recompute)
        self.runner.progressed.connect(self._on_progress)
        self.runner.succeeded.connect(self._on_search_done)
        self.runner.failed.connect(self._on_failed)
        self.runner.cancelled.connect(self._on_cancelled)
        self.runner.finished.connect(self._on_finished)
        self.bench_runner.progressed.connect(self._on_progress)
        self.bench_runner.succeeded.connect(self._on_workstation_done)
        self.bench_runner.failed.connect(
            lambda message: self._bench_ended(f"The calibration benchmark failed: {message}"))
        self.bench_runner.cancelled.connect(
            lambda: self._bench_ended("Benchmark cancelled; the calibration is unchanged."))
        self.device_runner.succeeded.connect(self._on_devices)
        self.acceptance_runner.succeeded.connect(self._on_acceptance)
        self.run_here_runner.progressed.connect(self._on_progress)
        self.run_here_runner.succeeded.connect(self._on_run_here_done)
        self.run_here_runner.failed.connect(
            lambda message: self._run_here_ended(f"Running the plan here failed: {message}",
                                                 "error"))
        self.detail_runner.succeeded.connect(self._on_detail)
        self.detail_runner.failed.connect(self._on_failed)
        on_click(self.cancel_button.clicked, self.cancel)
        on_click(self.scenario_button.clicked, self.keep_scenario)
        on_click(self.save_scenarios_button.clicked, lambda: self.save_scenarios())
        on_click(self.calibrate_button.clicked, lambda: self.calibrate())
        on_click(self.workstation_button.clicked, lambda: self.calibrate_workstation())
        on_click(self.run_here_button.clicked, lambda: self.run_here())
        on_click(self.report_button.clicked, lambda: self.export_report())
        self.present_button.toggled.connect(self.set_presentation)
        self.table.plan_selected.connect(self.choose)
        self.what_if.changed.connect(lambda _w: self._simulate_chosen())

    def _make_actions(self) -> list[QAction]:
        specs = [
            ("Recompute plans", "Ctrl+Shift+R", self.recompute),
            ("Cancel search", "Ctrl+Shift+X", self.cancel),
            ("Import config.json…", "Ctrl+Shift+I", lambda: self.form.import_config()),
            ("Keep as scenario", "Ctrl+Shift+S", self.keep_scenario),
            ("Save scenarios", "Ctrl+Alt+S", lambda: self.save_scenarios()),
            ("Calibrate from measured runs…", "Ctrl+Shift+B", lambda: self.calibrate()),
            ("Calibrate from this workstation", "Ctrl+Alt+B",
             lambda: self.calibrate_workstation()),
            ("Run the chosen plan here", "Ctrl+Alt+R", lambda: self.run_here()),
            ("Export report…", "Ctrl+Shift+E", lambda: self.export_report()),
            ("Presentation mode", "F11", self.present_button.toggle),
        ]
        return make_actions(self, specs)

    # ---- Pane protocol
    def start(self) -> None:
        """After the window shows: report a broken catalog, or rank the saved workload."""
        if self._catalog_error:
            self.notify.emit("error", self._catalog_error)
        self.restore_scenarios()
        self.refresh_acceptance()
        self.recompute()
        self.device_runner.start(gpu_probe_task)

    def refresh_acceptance(self) -> None:
        """Offer, once read in the background, the draft acceptance each monitored server
        measured; a broken database leaves the assumed figure, with one notice."""
        self.acceptance_runner.start(acceptance_task(self.store))

    def _on_acceptance(self, sources: list | Failure) -> None:
        if isinstance(sources, Failure):
            self._database_failed(Exception(sources.message))
            return
        self.form.set_acceptance_sources(sources)

    def save(self) -> None:
        """Persist the form beside the user's catalogs."""
        try:
            save_form(self.form.state(), self._form_folder)
        except (OSError, ValueError) as exc:
            self.notify.emit("warning", f"The planner form was not saved: {exc}")

    def shutdown(self) -> None:
        """Stop the search and the detail simulation (flag, quit, wait)."""
        self._debounce.stop()
        self._pending = False
        self.runner.stop()
        self.detail_runner.stop()
        self.bench_runner.stop()
        self.device_runner.stop()
        self.run_here_runner.stop()
        self.acceptance_runner.stop()
        self.store.close()

    # ---- public API
    def recompute(self) -> None:
        """Search again for the form's workload; a search still running is cancelled first."""
        self._debounce.stop()
        if self.runner.is_running():
            # Orange's pattern: cancel without blocking the UI; the next start waits for finished.
            self._pending = True
            self.runner.cancel()
            return
        self._pending = False
        self.status.setText("Searching…")
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.cancel_button.setEnabled(True)
        self.runner.start(search_task(self.form.state(), dict(self.form.imported),
                                      self.calibration))

    def cancel(self) -> None:
        """Stop the running search and calibration benchmark; the last ranking stays."""
        self._pending = False
        self.runner.cancel()
        self.bench_runner.cancel()

    # The model's state, read where the pane and its tests always read it.
    outcome = property(lambda self: self.model.outcome)
    chosen = property(lambda self: self.model.chosen)
    detail = property(lambda self: self.model.detail)
    calibration = property(lambda self: self.model.calibration)
    calibration_report = property(lambda self: self.model.calibration_report)
    scenarios = property(lambda self: self.model.scenarios)

    def choose(self, plan: Plan) -> None:
        """Make ``plan`` the one the charts, what-ifs and deploy commands describe."""
        self.model.choose(plan)

    def _show_chosen(self, plan: Plan) -> None:
        self.deploy.setPlainText("\n\n".join([
            "# vLLM, one replica", command_lines(command_or_reason(vllm_command, plan)),
            "# SGLang, one replica", command_lines(command_or_reason(sglang_command, plan)),
            "# Kubernetes", manifest_lines(command_or_reason(kubernetes_yaml, plan))]))
        self.copy_deploy_button.setEnabled(True)
        self.save_deploy_button.setEnabled(True)
        problem = run_here_problem(plan)
        self.run_here_button.setEnabled(not problem and not self.run_here_runner.is_running())
        self.run_here_button.setToolTip(problem or "Serve this plan on this machine, send its "
                                                   "workload and store the run beside the "
                                                   "prediction")
        self._simulate_chosen()
        # The note's bands are the chosen plan's (its calibration); the runs stay as read.
        self.validation_note.setText(trust_note(plan, self._runs_shown))

    def copy_deploy(self) -> None:
        """Put the chosen plan's commands and manifests on the clipboard."""
        if self.chosen is None:
            return
        QApplication.clipboard().setText(self.deploy.toPlainText())
        self.notify.emit("info", f"Copied the commands for {plan_label(self.chosen)}.")

    def save_deploy(self, path: str | Path = "") -> list[Path]:
        """Write the chosen plan's commands as a shell script and its Kubernetes manifests as
        YAML beside it; asks for the script's name when none is given."""
        plan = self.chosen
        if plan is None:
            self.notify.emit("warning", "Choose a plan before saving its commands.")
            return []
        if not path:
            path, _ = QFileDialog.getSaveFileName(self, "Save the deploy commands",
                                                  "servescope-deploy.sh", "Shell script (*.sh)")
            if not path:
                return []
        script, manifests = Path(path), Path(path).with_suffix(".yaml")
        try:
            script.write_text(deploy_script(plan), encoding="utf-8")
            manifests.write_text(manifest_lines(command_or_reason(kubernetes_yaml, plan)),
                                 encoding="utf-8")
        except OSError as exc:
            self.notify.emit("error", f"The commands could not be saved to {path}: "
                                      f"{exc.strerror or exc}")
            return []
        self.notify.emit("info", f"Saved {script} and {manifests.name}.")
        return [script, manifests]

    def keep_scenario(self) -> None:
        """Keep the current outcome for the side-by-side comparison (three at most)."""
        try:
            label = self.model.keep_scenario()
        except ValueError as exc:
            self.notify.emit("warning", str(exc))
            return
        self.scenario_table.show_scenarios(self.scenarios)
        self.tabs.setCurrentWidget(self.scenario_table)
        # Kept means kept: they are stored at once, so a restart shows them again.
        saved = self._store_scenarios()
        self.notify.emit("info", f"Kept scenario {label}." if saved
                         else f"Kept scenario {label} for this session (not saved).")

    def save_scenarios(self) -> int | None:
        """Keep the scenarios in the database; returns the saved row's id."""
        if not self.scenarios.items:
            self.notify.emit("warning", "Keep a scenario before saving scenarios.")
            return None
        row_id = self._store_scenarios()
        if row_id is not None:
            self.notify.emit("info", f"Saved {len(self.scenarios.items)} scenario(s).")
        return row_id

    def _store_scenarios(self) -> int | None:
        try:
            return self.store.save_scenarios(self.scenarios.as_json())
        except Exception as exc:  # noqa: BLE001 - any database failure; the pane goes on
            self._database_failed(exc)
            return None

    def restore_scenarios(self) -> int:
        """Show the scenarios saved last time; a broken database leaves the table empty."""
        try:
            rows = self.store.load_scenarios()
        except Exception as exc:  # noqa: BLE001 - any database failure; the pane goes on
            self._database_failed(exc)
            return 0
        count = self.scenarios.restore(rows)
        if count:
            self.scenario_table.show_scenarios(self.scenarios)
        return count

    def calibrate_workstation(self, quick: bool | None = None) -> bool:
        """Benchmark the demo model on this machine's engine in the background, then calibrate
        from every saved result (this one included). False when a benchmark already runs."""
        if self.bench_runner.is_running():
            self.notify.emit("warning", "The calibration benchmark is already running.")
            return False
        if quick is None and self.no_gpu_reason:
            self.notify.emit("warning", self.no_gpu_reason)
            return False
        self.status.setText("Benchmarking this workstation…")
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.cancel_button.setEnabled(True)
        self.workstation_button.setEnabled(False)
        self.bench_runner.start(workstation_task(quick))
        return True

    def calibrate(self, model: Model | None = None) -> CalibrationReport | None:
        """Fit the efficiency factors to the engine's saved benchmarks and stored load tests,
        then search again with them. `model`: one the engine benchmarked that the catalog
        lacks (the demo model)."""
        try:
            runs = self.store.load_tests()
        except Exception as exc:  # noqa: BLE001 - the engine's results still calibrate
            self._database_failed(exc)
            runs = []
        try:
            catalog = load_catalog()
            catalog = catalog.with_model(model) if model is not None else catalog
            report = calibrate_measured(load_engine_results(), runs, catalog)
        except USER_ERRORS as exc:
            self.notify.emit("warning", f"No calibration: {user_message(exc)}.")
            return None
        self.model.calibrated(report)
        skipped = f" Skipped: {'; '.join(report.skipped[:3])}." if report.skipped else ""
        self.notify.emit("info", f"Calibrated — {report.summary()}.{skipped}")
        self.recompute()
        return report

    def run_here(self) -> bool:
        """Run the chosen plan on this machine and store the run beside its prediction; the
        planner then calibrates from it. False (and a message) where the plan cannot run here."""
        plan = self.chosen
        reason = run_here_problem(plan)
        if reason or self.run_here_runner.is_running():
            self.notify.emit("warning", reason or "A plan is already running here.")
            return False
        self.run_here_button.setEnabled(False)
        self.progress.setVisible(True)
        self.run_here_runner.start(run_here_task(plan, self.outcome.form.workload(),
                                                 self.store.url, self.calibration,
                                                 engine=self.run_here_server.currentData()))
        return True

    def export_report(self, path: str | Path = "") -> list[Path]:
        """Write the report as HTML and PDF; asks for the file name when none is given."""
        if self.outcome is None or self.outcome.best is None:
            self.notify.emit("warning", "Run a search with a feasible plan before exporting.")
            return []
        if not path:
            path, _ = QFileDialog.getSaveFileName(self, "Export the planner report",
                                                  "servescope-plan.html", "HTML (*.html)")
            if not path:
                return []
        o = self.outcome
        charts = all_charts(o.result, o.best, o.detail, o.form)
        try:
            written = write_report(o, charts, Path(path), self.plan_runs())
        except OSError as exc:
            self.notify.emit("error", f"The report could not be written to {path}: "
                                      f"{exc.strerror or exc}")
            return []
        self.notify.emit("info", f"Report written to {written[0]} and {written[1].name}.")
        return written

    def set_presentation(self, on: bool) -> None:
        """Large type and no form, for a meeting room screen."""
        font = QFont(self._base_font)
        if on:
            font.setPointSizeF(self._base_font.pointSizeF() * PRESENTATION_SCALE)
        self.setFont(font)
        self.form_scroll.setVisible(not on)
        if self.present_button.isChecked() != on:
            self.present_button.setChecked(on)

    # ---- internals
    def _database_failed(self, exc: Exception) -> None:
        # One notification per session: a broken database should not nag on every click.
        if not self._db_reported:
            self._db_reported = True
            self.notify.emit("error", f"The planner's saved scenarios, load tests and measured "
                                      f"draft acceptance are unavailable: {exc}")

    def _on_devices(self, gpus: list) -> None:
        if gpus:
            return
        # A CPU result cannot calibrate a catalog GPU: say so before the user waits for one.
        self.no_gpu_reason = ("Calibrate here needs a CUDA GPU, and this machine's engine has "
                              "none: a CPU benchmark cannot calibrate the catalog's GPUs. Use "
                              "Calibrate… with load tests of your servers instead.")
        self.workstation_button.setEnabled(False)
        self.workstation_button.setToolTip(self.no_gpu_reason)

    def _on_progress(self, progress: Progress) -> None:
        if progress.fraction is not None:
            self.progress.setValue(int(progress.fraction * 1000))
        self.status.setText(progress.message.capitalize() + "…")

    def _bench_ended(self, message: str) -> None:
        self.workstation_button.setEnabled(not self.no_gpu_reason)
        self.cancel_button.setEnabled(self.runner.is_running())
        self.progress.setVisible(self.runner.is_running())
        self.status.setText(message)
        if "failed" in message:
            self.notify.emit("error", message)

    def _on_workstation_done(self, bench: WorkstationBench) -> None:
        r = bench.result
        rates = ", ".join(f"{n}: {tok_s:.0f}" for n, tok_s in
                          (r.get("throughput_tokens_per_s") or {}).items())
        done = (f"Benchmarked {r.get('model')} on {r.get('device')} (tok/s at concurrency "
                f"{rates})")
        self._bench_ended(done + "; calibrating…")
        if self.calibrate(bench.model) is None:
            self.status.setText(done + "; no calibration: see the message.")

    def _validation_page(self) -> QWidget:
        """How far to trust a plan: the published runs' error bands, then every plan run on
        this machine beside its prediction (Deploy → Run here adds one)."""
        self.validation_note = QLabel(wordWrap=True)
        self.validation_note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.validation_table = ValidationTable()
        self._runs_shown = 0
        page = QWidget()
        column = QVBoxLayout(page)
        column.addWidget(self.validation_note)
        column.addWidget(self.validation_table, 1)
        return page

    def plan_runs(self) -> list:
        """The plan runs made here, from the database (none, and one notice, if it fails)."""
        try:
            return self.store.load_plan_runs()
        except Exception as exc:  # noqa: BLE001 - the pane works without its database
            self._database_failed(exc)
            return []

    def refresh_validation(self) -> None:
        runs = self.plan_runs()
        self._runs_shown = len(runs)
        self.validation_table.show_runs(runs)
        self.validation_note.setText(trust_note(self.chosen, len(runs)))

    def _on_tab(self, index: int) -> None:
        if self.tabs.widget(index) is self.validation_page:
            self.refresh_validation()

    def _on_run_here_done(self, result: dict | Failure) -> None:
        if isinstance(result, Failure):
            self._run_here_ended(result.message, "error")
            return
        self.refresh_validation()
        p, m = result["predicted"], result["measured"]
        self._run_here_ended(
            f"Ran the plan here: {m['throughput_tok_s']:.1f} tok/s measured against "
            f"{p['throughput_tok_s']:.1f} predicted, TPOT p50 {m['tpot_p50_ms']:.0f} ms against "
            f"{p['tpot_p50_ms']:.0f} ms; stored as run {result['run_id']} (served by "
            f"{result['engine']}).", "info")
        self.calibrate()

    def _run_here_ended(self, message: str, level: str) -> None:
        self.run_here_button.setEnabled(not run_here_problem(self.chosen))
        self.progress.setVisible(self.runner.is_running())
        self.status.setText(message)
        self.notify.emit(level, message)

    def _on_search_done(self, result: Outcome | Failure | None) -> None:
        self.model.searched(result)

    def _on_model(self, event: str, payload: object) -> None:
        """Draw what changed in the model."""
        if event == "outcome":
            self._show_outcome(payload)
        elif event == "cleared":
            self._clear_plan(payload)
        elif event == "chosen":
            self._show_chosen(payload)
        elif event == "detail":
            self._show_detail(payload)

    def _show_outcome(self, result: Outcome) -> None:
        self.plan_banner.setVisible(False)
        self.plan_banner.setText("")
        r = result.result
        folded = f"; {r.folded} batch-limit variants folded" if r.folded else ""
        self.status.setText(f"{len(r.candidates)} plans meet every constraint "
                            f"({r.evaluated} candidates, {r.seconds:.1f} s{folded}).")
        self.recommendation.setText(self.model.recommendation())
        self.what_if.reset()
        self.table.set_plans(r.candidates)
        self.table.selectRow(0)
        self.outcome_ready.emit(result)

    def _clear_plan(self, reason: str) -> None:
        """Nothing of the previous plan stays on screen once the workload has none: ranking,
        recommendation, charts, what-ifs, Deploy text; the banner says why."""
        self.status.setText("No plan for this workload: see the reason above.")
        self.plan_banner.setText(f"No plan: {reason}")
        self.plan_banner.setVisible(True)
        self.table.set_plans([])
        self.recommendation.setText("")
        self.deploy.setPlainText("")
        self.copy_deploy_button.setEnabled(False)
        self.save_deploy_button.setEnabled(False)
        self.what_if.reset()
        self.what_if.verdict.setText("No plan to try changes on.")
        for chart in self.charts.values():
            chart.set_spec(ChartSpec(""))

    def _on_failed(self, message: str) -> None:
        self.status.setText("The planner failed.")
        self.notify.emit("error", message)

    def _on_cancelled(self) -> None:
        if not self._pending:
            self.status.setText("Search cancelled; the ranking shown is from the last search.")

    def _on_finished(self) -> None:
        self.cancel_button.setEnabled(self.bench_runner.is_running())
        self.progress.setVisible(self.bench_runner.is_running())
        if self._pending:
            self.recompute()

    def _simulate_chosen(self) -> None:
        if self.outcome is None or self.chosen is None:
            return
        what_if = self.what_if.what_if()
        if what_if.is_identity and self.chosen is self.outcome.best and self.outcome.detail:
            self.model.detailed(self.outcome.detail)
            return
        self.detail_runner.start(detail_task(self.outcome, self.chosen, what_if))

    def _on_detail(self, detail: Evaluation | Failure) -> None:
        if isinstance(detail, Failure):
            self.what_if.verdict.setText(detail.message)
            self._refresh_charts(None)
            return
        self.model.detailed(detail)

    def _show_detail(self, detail: Evaluation) -> None:
        self._refresh_charts(detail)
        self.what_if.verdict.setText(self.model.verdict(detail, self.what_if.what_if()))
        self.detail_ready.emit(detail)

    def _refresh_charts(self, detail: Evaluation | None) -> None:
        o, w = self.outcome, self.what_if.what_if()
        specs = all_charts(o.result, self.chosen, detail, o.form, w.spot_share, w.rate_scale,
                           w.replicas_delta)
        for key, spec in specs.items():
            self.charts[key].set_spec(spec)


RUN_HERE_NEEDS = ("Choose a plan on this machine to run it here (add the machine with "
                  "`servescope plan machine`, then tick it under GPU types)")
# The "Run here" server choices (app.plan_run.ENGINES), as the combo box labels them.
RUN_HERE_SERVERS = (("auto: vLLM where installed", "auto"), ("vLLM", "vllm"),
                    ("servescope serve", "servescope"))


def run_here_problem(plan: Plan | None) -> str:
    """Why the plan cannot run on this machine from the pane ('' when it can)."""
    if plan is None:
        return RUN_HERE_NEEDS
    if not plan.deployment.gpu.source.startswith(MEASURED_HERE):
        return f"This plan is for {plan.deployment.gpu.name}: {RUN_HERE_NEEDS[0].lower()}" \
               f"{RUN_HERE_NEEDS[1:]}"
    if plan.deployment.model.hf_id != DEMO_HF_ID:
        return (f"Only the demo model runs here from the pane; run {plan.deployment.model.name} "
                "with `servescope plan run-here --model-path ...`")
    try:
        servescope_serve_args(plan)
    except NotServable as exc:
        return f"This plan cannot run here: {exc}"
    return ""


def acceptance_task(store: PlannerStore):
    """The measured acceptance by draft position of every recorded source (a worker task)."""
    def task(_cancel) -> object:
        yield Progress(None, "reading the monitor's measured draft acceptance")
        try:
            return store.acceptance_sources()
        except Exception as exc:  # noqa: BLE001 - any database failure; the pane goes on
            return Failure(str(exc))
    return task


def gpu_probe_task(_cancel) -> object:
    """The engine's CUDA GPUs (imports torch, so on a worker thread)."""
    from engine.memory import device_memory

    yield Progress(None, "looking for GPUs")
    return [d for d in device_memory() if d.kind == "cuda"]


def deploy_script(plan: Plan) -> str:
    """A shell script starting one replica with vLLM, SGLang's equivalent commented out; with
    SGLang where vLLM cannot run the plan (the script says why). A replica over several nodes
    says how each server spans them."""
    vllm = command_or_reason(vllm_command, plan)
    sglang = command_lines(command_or_reason(sglang_command, plan))
    nodes = plan.deployment.nodes
    head = f"#!/bin/sh\n# {plan_label(plan)}, one replica (servescope).\n"
    sglang_nodes = (f"# SGLang over {nodes} nodes: run its command on each, with NODE_RANK=0 on "
                    f"the first and 1..{nodes - 1} on the others, LEADER_ADDR the first "
                    "node's address.\n") if nodes > 1 else ""
    if vllm.startswith("#"):
        return f"{head}\n# vLLM\n{vllm}\n\n# SGLang\n{sglang_nodes}{sglang}\n"
    if nodes > 1:
        head += (f"# vLLM over {nodes} nodes: start a Ray cluster on them first (ray start "
                 "--head on this node, ray start --address on the others), then run this "
                 "here.\n")
    commented = "\n".join(line if line.startswith("#") else f"# {line}"
                          for line in sglang.splitlines())
    return (f"{head}\n# vLLM\n{command_lines(vllm)}\n\n# Or SGLang:\n{sglang_nodes}"
            f"{commented}\n")
