"""The Planner's workload and options form: widgets in, a FormState out, `changed` on every edit."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.navigation import on_click
from app.panes.planner.state import DAILY_PROFILES, FormState
from app.panes.planner.tasks import USER_ERRORS, user_message
from planner.catalog import Catalog, Model
from planner.hf_import import model_from_hf_config
from planner.workload import ARRIVALS, LENGTHS

ASSUMED_ACCEPTANCE = "assumed: 4 draft tokens, 70% accepted each"


def acceptance_label(name: str, rates) -> str:
    """'measured on vllm-a: 2.31 tokens a step (3 draft tokens)'."""
    return (f"measured on {name}: {1.0 + sum(rates):.2f} tokens a step "
            f"({len(rates)} draft tokens)")


WEIGHT_CHOICES = ("bf16", "fp8", "int8", "int4")
KV_CHOICES = ("bf16", "fp8", "int8")


def _spin(low: float, high: float, step: float, decimals: int = 0, suffix: str = "") -> QWidget:
    if decimals == 0:
        box = QSpinBox()
        box.setRange(int(low), int(high))
        box.setSingleStep(int(step))
    else:
        box = QDoubleSpinBox()
        box.setDecimals(decimals)
        box.setRange(low, high)
        box.setSingleStep(step)
    box.setSuffix(suffix)
    box.setKeyboardTracking(False)  # one search per finished number, not one per keystroke
    return box


def _combo(items: tuple[str, ...] | list[str]) -> QComboBox:
    box = QComboBox()
    box.addItems(list(items))
    return box


class WorkloadForm(QWidget):
    """Model, traffic, lengths, SLOs, budget and the search options."""

    changed = Signal()
    notify = Signal(str, str)

    def __init__(self, catalog: Catalog | None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.imported: dict[str, Model] = {}
        models = sorted(catalog.models) if catalog else []
        gpus = list(catalog.gpus) if catalog else []
        self.model = _combo(models)
        self.model.setEditable(True)
        self.import_button = QPushButton("Import config.json…")
        self.rate = _spin(0.01, 100000, 1, 2, " req/s")
        self.profile = _combo(tuple(DAILY_PROFILES))
        self.arrival = _combo(ARRIVALS)
        self.input_len = _spin(1, 1_000_000, 128, suffix=" tok")
        self.input_dist = _combo(LENGTHS)
        self.output_len = _spin(1, 1_000_000, 64, suffix=" tok")
        self.output_dist = _combo(LENGTHS)
        self.prefix_share = _spin(0.0, 0.95, 0.05, 2)
        self.ttft = _spin(1, 600_000, 100, 0, " ms")
        self.tpot = _spin(1, 10_000, 5, 0, " ms")
        self.budget = _spin(0, 1_000_000, 10, 2, " $/h")
        self.budget.setSpecialValueText("no budget")
        self.gpus = QListWidget()
        for name in gpus:
            item = QListWidgetItem(name)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Unchecked)
            self.gpus.addItem(item)
        self.gpus.setMaximumHeight(150)
        self.weights = {p: QCheckBox(p) for p in WEIGHT_CHOICES}
        self.kv = {p: QCheckBox(p) for p in KV_CHOICES}
        self.speculative = QCheckBox("speculative decoding (EAGLE)")
        self.speculative.setToolTip("4 draft tokens, 70% accepted each (planner.timing.SpecDecode)")
        # Where the draft's acceptance comes from: assumed, or measured by a server the monitor
        # recorded (set_acceptance_sources fills it in).
        self.acceptance = QComboBox()
        self.acceptance.setToolTip("Draft acceptance by position as a monitored server measured "
                                   "it (servescope record, or the Monitor tab), or assumed")
        self.acceptance.addItem(ASSUMED_ACCEPTANCE, None)
        self.spot_share = _spin(0.0, 1.0, 0.1, 2)
        self.autoscale = QCheckBox("autoscale replicas over the day")
        self._build()
        self.set_state(FormState())
        self._connect()

    def _build(self) -> None:
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(self.import_button)
        work = QFormLayout()
        work.addRow("Model", model_row)
        work.addRow("Peak rate", self.rate)
        work.addRow("Daily profile", self.profile)
        work.addRow("Arrivals", self.arrival)
        work.addRow("Input length", self._pair(self.input_len, self.input_dist))
        work.addRow("Output length", self._pair(self.output_len, self.output_dist))
        work.addRow("Prefix share", self.prefix_share)
        targets = QFormLayout()
        targets.addRow("p99 TTFT", self.ttft)
        targets.addRow("p99 TPOT", self.tpot)
        targets.addRow("Budget", self.budget)
        options = QFormLayout()
        options.addRow("GPU types", self.gpus)
        options.addRow("Weights", self._row(list(self.weights.values())))
        options.addRow("KV cache", self._row(list(self.kv.values())))
        options.addRow("", self.speculative)
        options.addRow("Draft acceptance", self.acceptance)
        options.addRow("Spot share", self.spot_share)
        options.addRow("", self.autoscale)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for title, form in (("Workload", work), ("Targets", targets), ("Options", options)):
            box = QGroupBox(title)
            box.setLayout(form)
            layout.addWidget(box)
        layout.addStretch(1)

    @staticmethod
    def _pair(a: QWidget, b: QWidget) -> QHBoxLayout:
        row = QHBoxLayout()
        row.addWidget(a, 1)
        row.addWidget(b)
        return row

    @staticmethod
    def _row(widgets: list[QWidget]) -> QHBoxLayout:
        row = QHBoxLayout()
        for w in widgets:
            row.addWidget(w)
        row.addStretch(1)
        return row

    def _connect(self) -> None:
        on_click(self.import_button.clicked, self.import_config)
        self.model.currentTextChanged.connect(self.changed)
        for box in (self.rate, self.input_len, self.output_len, self.prefix_share, self.ttft,
                    self.tpot, self.budget, self.spot_share):
            box.valueChanged.connect(self.changed)
        for combo in (self.profile, self.arrival, self.input_dist, self.output_dist,
                      self.acceptance):
            combo.currentIndexChanged.connect(self.changed)
        for check in [*self.weights.values(), *self.kv.values(), self.speculative,
                      self.autoscale]:
            check.toggled.connect(self.changed)
        self.speculative.toggled.connect(self.acceptance.setEnabled)
        self.gpus.itemChanged.connect(self.changed)

    # ---- public API
    def state(self) -> FormState:
        """The form's values as a FormState."""
        checked = [self.gpus.item(i).text() for i in range(self.gpus.count())
                   if self.gpus.item(i).checkState() == Qt.CheckState.Checked]
        return FormState(
            model=self.model.currentText().strip(), rate=self.rate.value(),
            profile=self.profile.currentText(), arrival=self.arrival.currentText(),
            input_len=self.input_len.value(), input_dist=self.input_dist.currentText(),
            output_len=self.output_len.value(), output_dist=self.output_dist.currentText(),
            prefix_share=self.prefix_share.value(), ttft_p99_ms=float(self.ttft.value()),
            tpot_p99_ms=float(self.tpot.value()), budget_per_hour=self.budget.value(),
            gpus=tuple(checked),
            weights=tuple(p for p, c in self.weights.items() if c.isChecked()),
            kv=tuple(p for p, c in self.kv.items() if c.isChecked()),
            speculative=self.speculative.isChecked(), spot_share=self.spot_share.value(),
            autoscale=self.autoscale.isChecked(), **self._acceptance())

    def _acceptance(self) -> dict:
        measured = self.acceptance.currentData()
        if not measured:
            return {}
        name, rates = measured
        return {"spec_measured_on": name, "spec_accepted_at": tuple(rates)}

    def set_acceptance_sources(self, sources: list[tuple[str, list[float]]]) -> None:
        """Offer each monitored server's measured acceptance by draft position (keeping the
        current choice where it is still offered)."""
        current = self.acceptance.currentData()
        self.acceptance.blockSignals(True)
        try:
            self.acceptance.clear()
            self.acceptance.addItem(ASSUMED_ACCEPTANCE, None)
            for name, rates in sources:
                self.acceptance.addItem(acceptance_label(name, rates), (name, list(rates)))
            if current and current[0] not in {name for name, _ in sources}:
                # The chosen measurement stays as it was, though its source is no longer
                # stored (retention, another database): the plans keep using it.
                self.acceptance.addItem(acceptance_label(*current), current)
            self._select_acceptance(current[0] if current else "")
        finally:
            self.acceptance.blockSignals(False)

    def _select_acceptance(self, name: str) -> None:
        for i in range(self.acceptance.count()):
            data = self.acceptance.itemData(i)
            if (data[0] if data else "") == name:
                self.acceptance.setCurrentIndex(i)
                return
        self.acceptance.setCurrentIndex(0)

    def set_state(self, form: FormState) -> None:
        """Show ``form``'s values, emitting a single `changed` at the end."""
        self.blockSignals(True)
        try:
            self._apply(form)
        finally:
            self.blockSignals(False)
        self.changed.emit()

    def _apply(self, form: FormState) -> None:
        self.model.setCurrentText(form.model)
        self.rate.setValue(form.rate)
        self.profile.setCurrentText(form.profile)
        self.arrival.setCurrentText(form.arrival)
        self.input_len.setValue(form.input_len)
        self.input_dist.setCurrentText(form.input_dist)
        self.output_len.setValue(form.output_len)
        self.output_dist.setCurrentText(form.output_dist)
        self.prefix_share.setValue(form.prefix_share)
        self.ttft.setValue(int(form.ttft_p99_ms))
        self.tpot.setValue(int(form.tpot_p99_ms))
        self.budget.setValue(form.budget_per_hour)
        for i in range(self.gpus.count()):
            item = self.gpus.item(i)
            item.setCheckState(Qt.CheckState.Checked if item.text() in form.gpus
                               else Qt.CheckState.Unchecked)
        for p, check in self.weights.items():
            check.setChecked(p in form.weights)
        for p, check in self.kv.items():
            check.setChecked(p in form.kv)
        self.speculative.setChecked(form.speculative)
        self.acceptance.setEnabled(form.speculative)
        if form.spec_measured_on and self.acceptance.findText(
                acceptance_label(form.spec_measured_on, form.spec_accepted_at)) < 0:
            # A saved form's measurement, offered again as it was (the source may be gone).
            self.acceptance.addItem(acceptance_label(form.spec_measured_on,
                                                     form.spec_accepted_at),
                                    (form.spec_measured_on, list(form.spec_accepted_at)))
        self._select_acceptance(form.spec_measured_on)
        self.spot_share.setValue(form.spot_share)
        self.autoscale.setChecked(form.autoscale)

    def import_config(self, path: str = "") -> bool:
        """Add a model from a Hugging Face config.json (asks for the file when none is given)."""
        if not path:
            path, _ = QFileDialog.getOpenFileName(self, "Import a Hugging Face config.json", "",
                                                  "config.json (*.json)")
            if not path:
                return False
        try:
            model = model_from_hf_config(path)
        except USER_ERRORS as exc:
            self.notify.emit("error", user_message(exc))
            return False
        self.imported[model.name] = model
        if self.model.findText(model.name) < 0:
            self.model.addItem(model.name)
        self.model.setCurrentText(model.name)
        self.notify.emit("info", f"Imported {model.name} ({model.params_b:.1f} B parameters).")
        return True
