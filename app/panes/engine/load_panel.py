"""Load panel: device, dtype, weight format and KV sizing, the memory estimate, and load /
cancel / unload."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.navigation import on_click
from app.panes.engine.state import (
    EngineInfo,
    LoadRequest,
    changed_options,
    format_bytes,
    memory_verdict,
)
from app.settings import Settings
from app.theme import LEVEL_COLOURS, current_theme
from app.workers import Progress, TaskRunner
from engine.spec.config import parse_spec

DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_DTYPE_LABEL = "Auto (bf16 where native, else fp32)"  # the tooltip says where
# engine.kv_eviction.POLICIES with what each keeps (the engine module imports torch).
KV_POLICIES = (
    ("none", "No eviction", "Keep every token"),
    ("streaming", "StreamingLLM", "Attention sinks + a recent window"),
    ("h2o", "H2O", "Heavy hitters (most attention so far) + a recent window"),
    ("scissorhands", "Scissorhands", "Persistently important tokens + a recent window"),
    ("snapkv", "SnapKV", "The prompt compressed once at its end + a recent window"),
)
DRAFT_FILE = "draft-file"  # the speculative choice that asks for a draft model file
# engine.quantize's formats (WEIGHT_CHOICES), named for the combo box.
WEIGHT_LABELS = {"float": "float (as the dtype)", "int8": "int8, per channel",
                 "int4": "int4, groups of 32", "int4:g64": "int4, groups of 64",
                 "int4:g128": "int4, groups of 128"}
KV_CACHE_DTYPE_LABELS = {"auto": "as the dtype", "int8": "int8", "fp8": "fp8 (e4m3)"}


def probe_task(_cancel: threading.Event) -> Generator[Progress, None, list[Any]]:
    """Background task: the devices and their memory (imports torch, so never on the GUI thread)."""
    from engine.memory import device_memory

    yield Progress(None, "Looking for devices")
    return device_memory()


def read_model_header(model: str) -> None:
    """Read `model`'s header once (engine.memory.read_header caches it per file and mtime)."""
    from engine.memory import read_header
    from engine.models import resolve_model

    path = resolve_model(model)
    read_header(path, path.stat().st_mtime_ns)


def header_task(model: str):
    """Background task: read the header, so the estimate never parses a GGUF's metadata on the
    GUI thread."""

    def task(_cancel: threading.Event) -> Generator[Progress, None, str]:
        yield Progress(None, f"Reading {model}'s header")
        read_model_header(model)
        return model

    return task


class LoadPanel(QGroupBox):
    """Where and how to load: device, dtype, context and concurrency, with the memory they need."""

    load_requested = Signal(object)
    cancel_requested = Signal()
    unload_requested = Signal()
    notify = Signal(str, str)

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__("Load", parent)
        self._settings = settings
        self._model = ""
        self._devices: list[Any] = []
        self._estimate: Any = None
        self._idle = True
        self.device_combo = QComboBox()
        self.dtype_combo = QComboBox()
        self.context_spin = QSpinBox(minimum=64, maximum=131072, singleStep=256)
        self.concurrency_spin = QSpinBox(minimum=1, maximum=256)
        self.spec_combo = QComboBox()
        self.prefix_check = QCheckBox("Share prefixes")
        self.kv_policy_combo = QComboBox()
        self.kv_budget_edit = QLineEdit(placeholderText="budget: 512 or 0.2")
        self.weights_combo = QComboBox()
        self.kv_dtype_combo = QComboBox()
        self.estimate_label = QLabel(wordWrap=True)
        self.load_button = QPushButton("Load")
        self.cancel_button = QPushButton("Cancel load")
        self.unload_button = QPushButton("Unload")
        self.progress = QProgressBar()
        self.status_label = QLabel(wordWrap=True)
        self.fallback_label = QLabel(wordWrap=True)
        # Options changed after loading apply on the next load: say so, never silently.
        self.reload_label = QLabel(wordWrap=True, objectName="engine-needs-reload")
        self.reload_label.setVisible(False)
        self._requested: LoadRequest | None = None
        self._loaded: LoadRequest | None = None
        self._prober = TaskRunner(self)
        # Headers read so far (the estimate waits for them) and one waiting its turn.
        self._header_reader = TaskRunner(self)
        self._headers_read: set[str] = set()
        self._header_next: str | None = None
        self._header_current = ""
        self._build()
        self._restore()
        self._connect()
        self.set_state("no model")

    def _build(self) -> None:
        self.device_combo.addItem("Auto (a GPU if there is one)", "auto")
        self.device_combo.addItem("CPU", "cpu")
        for dtype in DTYPES:
            self.dtype_combo.addItem(AUTO_DTYPE_LABEL if dtype == "auto" else dtype, dtype)
        self.dtype_combo.setToolTip("Auto: bfloat16 on GPUs and on CPUs with bfloat16 "
                                    "instructions (AVX512-BF16 or AMX), else float32")
        for value, label in WEIGHT_LABELS.items():
            self.weights_combo.addItem(label, value)
        self.weights_combo.setToolTip("Weight-only quantization of the decoder's matmuls; the "
                                      "embedding and norms stay float, the LM head is int8")
        for value, label in KV_CACHE_DTYPE_LABELS.items():
            self.kv_dtype_combo.addItem(label, value)
        self.kv_dtype_combo.setToolTip("KV cache storage: the model's dtype, or int8 / fp8 with a "
                                       "scale per token and KV head (about a quarter of float32's "
                                       "memory; fp8 needs a GPU with fp8 on CUDA)")
        self.context_spin.setSuffix(" tokens")
        self.context_spin.setToolTip("Longest conversation one request may hold (max_model_len)")
        self.concurrency_spin.setToolTip("Requests the KV cache must hold at full context at once")
        self.spec_combo.addItem("Off", "off")
        self.spec_combo.addItem("Prompt lookup (n-gram), up to 10 draft tokens", "ngram:k=10")
        self.spec_combo.addItem(_shipped_draft_label("Demo model's own draft", "demo-draft"),
                                "demo-draft")
        self.spec_combo.addItem(_shipped_draft_label("Demo model's Medusa heads", "demo-medusa"),
                                "demo-medusa")
        self.spec_combo.addItem("Draft model file…", DRAFT_FILE)
        self.spec_combo.setToolTip("Speculative decoding: lossless. Prompt lookup pays off when "
                                   "replies copy from the prompt (edits, summaries, code); the "
                                   "demo draft and Medusa heads speed up the demo model's "
                                   "open chat too")
        self.prefix_check.setToolTip("Prefix caching: requests that share a beginning (a system "
                                     "prompt, earlier chat turns) reuse its KV blocks")
        for i, (policy, label, tip) in enumerate(KV_POLICIES):
            self.kv_policy_combo.addItem(label, policy)
            self.kv_policy_combo.setItemData(i, tip, Qt.ItemDataRole.ToolTipRole)
        self.kv_policy_combo.setToolTip("KV-cache eviction: keep only the cached tokens "
                                        "attention still uses, within the budget")
        self.kv_budget_edit.setMaximumWidth(140)
        self.kv_budget_edit.setToolTip("KV entries each request keeps: tokens (e.g. 512) or a "
                                       "fraction of its length (e.g. 0.2)")
        form = QFormLayout()
        form.addRow("Device", self.device_combo)
        # Dtype and weight format share a row: the window must still fit 760 px high.
        precision = QHBoxLayout()
        precision.addWidget(self.dtype_combo, 1)
        precision.addWidget(QLabel("Weights"))
        precision.addWidget(self.weights_combo, 1)
        precision.addWidget(QLabel("KV"))
        precision.addWidget(self.kv_dtype_combo, 1)
        form.addRow("Dtype", precision)
        # Context and concurrency share a row, as do the KV options, to keep the panel short.
        sizing = QHBoxLayout()
        sizing.addWidget(self.context_spin)
        sizing.addWidget(QLabel("×"))
        sizing.addWidget(self.concurrency_spin)
        sizing.addWidget(QLabel("requests"), 1)
        kv = QHBoxLayout()
        kv.addWidget(self.kv_policy_combo)
        kv.addWidget(self.kv_budget_edit)
        kv.addWidget(self.prefix_check, 1)
        form.addRow("Context", sizing)
        form.addRow("Speculative", self.spec_combo)
        form.addRow("KV cache", kv)
        form.addRow("Memory", self.estimate_label)
        buttons = QHBoxLayout()
        for button in (self.load_button, self.cancel_button, self.unload_button):
            buttons.addWidget(button)
        buttons.addWidget(self.progress, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.status_label)
        layout.addWidget(self.reload_label)
        layout.addWidget(self.fallback_label)
        self.fallback_label.setVisible(False)

    def _restore(self) -> None:
        s = self._settings
        self._select(self.dtype_combo, s.get("engine/dtype"))
        self._select(self.device_combo, s.get("engine/device"))
        self.context_spin.setValue(s.get("engine/context_tokens"))
        self.concurrency_spin.setValue(s.get("engine/concurrency"))
        spec = s.get("engine/speculative")
        if isinstance(spec, str) and spec.startswith("draft:"):
            self.set_draft_file(spec.removeprefix("draft:"))
        self._select(self.spec_combo, spec)
        self.prefix_check.setChecked(s.get("engine/prefix_caching"))
        self._select(self.kv_policy_combo, s.get("engine/kv_policy"))
        self.kv_budget_edit.setText(s.get("engine/kv_budget"))
        self._enable_budget()
        self._select(self.weights_combo, s.get("engine/weights"))
        self._select(self.kv_dtype_combo, s.get("engine/kv_cache_dtype"))

    def _connect(self) -> None:
        self.device_combo.currentIndexChanged.connect(self._on_choice_changed)
        self.dtype_combo.currentIndexChanged.connect(self._on_choice_changed)
        self.context_spin.valueChanged.connect(self._on_choice_changed)
        self.concurrency_spin.valueChanged.connect(self._on_choice_changed)
        self.spec_combo.currentIndexChanged.connect(self._on_spec_changed)
        self.prefix_check.toggled.connect(self._on_choice_changed)
        self.kv_policy_combo.currentIndexChanged.connect(self._on_choice_changed)
        self.kv_budget_edit.textChanged.connect(self._on_choice_changed)
        self.weights_combo.currentIndexChanged.connect(self._on_choice_changed)
        self.kv_dtype_combo.currentIndexChanged.connect(self._on_choice_changed)
        on_click(self.load_button.clicked, self.request_load)
        on_click(self.cancel_button.clicked, self.cancel_requested.emit)
        on_click(self.unload_button.clicked, self.request_unload)
        # A header that failed to read counts as read too: the estimate then says why, once.
        self._header_reader.succeeded.connect(self._on_header_read)
        self._header_reader.failed.connect(self._on_header_read)
        self._header_reader.finished.connect(self._read_next_header)
        self._prober.succeeded.connect(self._on_devices)
        self._prober.failed.connect(lambda msg: self.notify.emit("warning",
                                    f"Could not list the devices ({msg}); the CPU is available."))

    # ---- public API
    def probe_devices(self) -> None:
        """Find the GPUs in the background (this is where torch gets imported)."""
        self._prober.start(probe_task)

    def set_model(self, model: str) -> None:
        """The model chosen in the picker; refreshes the estimate once its header is read."""
        self._model = model
        if model and model not in self._headers_read:
            self._read_header(model)
        self._update_estimate()
        self.load_button.setEnabled(bool(model) and self._idle)
        self._show_pending_changes()

    def set_draft_file(self, path: str) -> None:
        """Offer `path` (a draft model sharing the target's tokenizer) and select it."""
        data = f"draft:{path}"
        index = self.spec_combo.findData(data)
        if index < 0:
            index = self.spec_combo.count() - 1  # above "Draft model file…"
            # Inserting above the current item moves the index: no "changed" for that.
            with QSignalBlocker(self.spec_combo):
                self.spec_combo.insertItem(index, f"Draft model: {path}", data)
        self.spec_combo.setCurrentIndex(index)

    def current_request(self) -> LoadRequest:
        """The load the controls describe (ValueError when no model is chosen or the KV budget
        is not a number)."""
        policy = self.kv_policy_combo.currentData()
        return LoadRequest(self._model, self.device_combo.currentData(),
                           self.dtype_combo.currentData(), self.context_spin.value(),
                           self.concurrency_spin.value(), self.spec_combo.currentData(),
                           self.prefix_check.isChecked(), policy,
                           self._kv_budget() if policy != "none" else None,
                           self.weights_combo.currentData(), self.kv_dtype_combo.currentData())

    def request_load(self) -> None:
        """Ask for a load, unless the estimate shows the model cannot fit at all."""
        if not self._idle:
            return  # the shortcut reaches here too; one load or reply at a time
        if not self._model:
            self.notify.emit("error", "Choose a model first: fetch the demo model or open one.")
            return
        if self._model not in self._headers_read:
            # Load pressed before the background read ended: the fit check needs the header,
            # so read it here (the one case that waits on the GUI thread).
            self._read_header_now(self._model)
        level, sentence = self._verdict()
        if level == "error":
            self.notify.emit("error", f"{self._model} will not fit. {sentence}")
            return
        if level == "warning":
            self.notify.emit("warning", sentence)
        try:
            request = self.current_request()
        except ValueError as exc:  # a KV budget that is not a number
            self.notify.emit("error", str(exc))
            return
        self._requested = request
        self.load_requested.emit(request)

    def request_unload(self) -> None:
        """Ask to free the model, when one is loaded and idle."""
        if self.unload_button.isEnabled():
            self.unload_requested.emit()

    def set_state(self, state: str) -> None:
        """Enable the buttons that make sense in the engine's ``state``."""
        self._idle = state in ("no model", "ready")
        busy_loading = state in ("loading", "cancelling")
        self.load_button.setEnabled(self._idle and bool(self._model))
        self.cancel_button.setEnabled(state == "loading")
        self.unload_button.setEnabled(state == "ready")
        self.progress.setVisible(busy_loading)
        if state == "no model":
            self.status_label.setText("No model loaded.")
            self.fallback_label.setVisible(False)
            self._loaded = None
            self._show_pending_changes()
        elif state == "cancelling":
            self.status_label.setText("Cancelling the load…")

    def set_progress(self, fraction: float, message: str) -> None:
        """Show the load's progress."""
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(fraction * 1000))
        self.status_label.setText(message)

    def show_loaded(self, info: EngineInfo) -> None:
        """Show what was loaded, and why it is not where it was asked for, if it is not."""
        self.status_label.setText(info.summary())
        self._loaded = self._requested
        self._show_pending_changes()
        self.fallback_label.setVisible(bool(info.fallback_reason))
        if info.fallback_reason:
            background, border = LEVEL_COLOURS[current_theme()]["warning"]
            self.fallback_label.setStyleSheet(f"background: {background}; padding: 4px;"
                                              f" border-left: 3px solid {border};")
            self.fallback_label.setText(f"Fallback: {info.fallback_reason}")
            self.notify.emit("warning", info.fallback_reason)

    def save(self) -> None:
        """Persist the controls."""
        s = self._settings
        s.set("engine/device", self.device_combo.currentData())
        s.set("engine/dtype", self.dtype_combo.currentData())
        s.set("engine/context_tokens", self.context_spin.value())
        s.set("engine/concurrency", self.concurrency_spin.value())
        s.set("engine/speculative", self.spec_combo.currentData())
        s.set("engine/prefix_caching", self.prefix_check.isChecked())
        s.set("engine/kv_policy", self.kv_policy_combo.currentData())
        s.set("engine/kv_budget", self.kv_budget_edit.text().strip())
        s.set("engine/weights", self.weights_combo.currentData())
        s.set("engine/kv_cache_dtype", self.kv_dtype_combo.currentData())

    def shutdown(self) -> None:
        """Stop the device probe and the header read (flag, quit, wait)."""
        self._prober.stop()
        self._header_reader.stop()

    def _read_header(self, model: str) -> None:
        # One read at a time: starting another would wait for this one on the GUI thread.
        if self._header_reader.is_running():
            self._header_next = model
            return
        self._start_header(model)

    def _start_header(self, model: str) -> None:
        self._header_current = model
        self._header_reader.start(header_task(model))

    def _on_header_read(self, _result: object = None) -> None:
        self._headers_read.add(self._header_current)
        self._update_estimate()

    def _read_header_now(self, model: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # the estimate shows why, and the load
            read_model_header(model)
        self._headers_read.add(model)
        self._update_estimate()

    def _read_next_header(self) -> None:
        waiting, self._header_next = self._header_next, None
        if waiting is not None and waiting not in self._headers_read:
            self._start_header(waiting)  # start() joins the thread that just finished

    # ---- internals
    def _on_spec_changed(self) -> None:
        if self.spec_combo.currentData() == DRAFT_FILE:
            path, _ = QFileDialog.getOpenFileName(
                self, "Choose a draft model", "",
                "Draft models (*.gguf *.safetensors config.json);;All files (*)")
            if path:
                # An HF folder is named by its config.json; the loader wants the folder.
                self.set_draft_file(path.removesuffix("/config.json"))
            else:
                self.spec_combo.setCurrentIndex(0)
            return
        self._on_choice_changed()

    def _on_devices(self, devices: list[Any]) -> None:
        self._devices = list(devices)
        wanted = self._settings.get("engine/device")
        for device in self._devices:
            if device.kind == "cuda":
                data = f"cuda:{device.index}"
                if self.device_combo.findData(data) < 0:
                    self.device_combo.addItem(f"GPU {device.index}: {device.name}", data)
        self._select(self.device_combo, wanted)
        self._update_estimate()

    def _on_choice_changed(self, *_: object) -> None:
        self._enable_budget()
        self.save()
        self._update_estimate()
        self._show_pending_changes()

    def pending_changes(self) -> list[str]:
        """The options set differently from the loaded model's; empty when none is loaded."""
        try:
            wanted = self.current_request()
        except ValueError:
            wanted = None
        return changed_options(self._loaded, wanted)

    def _show_pending_changes(self) -> None:
        changed = self.pending_changes()
        self.load_button.setText("Reload" if changed else "Load")
        self.reload_label.setVisible(bool(changed))
        if changed:
            background, border = LEVEL_COLOURS[current_theme()]["warning"]
            self.reload_label.setStyleSheet(f"background: {background}; padding: 4px;"
                                            f" border-left: 3px solid {border};")
            self.reload_label.setText(
                f"Changed since loading: {', '.join(changed)}. Press Reload to apply; replies "
                "use the loaded settings until then.")

    def _enable_budget(self) -> None:
        self.kv_budget_edit.setEnabled(self.kv_policy_combo.currentData() != "none")

    def _kv_budget(self) -> int | float | None:
        """The budget field as tokens or a fraction; None when empty (the engine then says a
        policy needs one)."""
        from engine.kv_options import parse_kv_budget

        text = self.kv_budget_edit.text().strip()
        return parse_kv_budget(text) if text else None

    def _update_estimate(self) -> None:
        self._estimate = None
        if not self._model:
            self.estimate_label.setText("Choose a model to see the memory it needs.")
            return
        if self._model not in self._headers_read:
            self.estimate_label.setText(f"Reading {Path(self._model).name}'s header for the "
                                        "memory estimate…")
            return
        try:
            target = self._target_device()
            device = "cpu" if target is None else target.kind
            request = self.current_request()
            config = request.engine_config()
            self._estimate = config.memory_estimate(request.context_tokens,
                                                    request.concurrency, device)
            plain = replace(config, weights="float", kv_cache_dtype="auto").memory_estimate(
                request.context_tokens, request.concurrency, device)
        except Exception as exc:  # an unreadable header is reported here and again on load
            self.estimate_label.setText(f"No estimate: {exc}")
            return
        level, sentence = self._verdict()
        e = self._estimate
        detail = (f"weights {format_bytes(e.weight_bytes)} + KV cache {format_bytes(e.kv_bytes)}"
                  f" + activations {format_bytes(e.activation_bytes)}")
        saving = "".join(f"\n{line}" for line in _savings(request, config.concrete_dtype(device),
                                                             e, plain))
        colour = {"ok": "", "warning": LEVEL_COLOURS[current_theme()]["warning"][1],
                  "error": LEVEL_COLOURS[current_theme()]["error"][1]}[level]
        self.estimate_label.setStyleSheet(f"color: {colour};" if colour else "")
        self.estimate_label.setText(f"{sentence}\n({detail}){saving}")

    def _target_device(self) -> Any:
        choice = self.device_combo.currentData()
        cuda = [d for d in self._devices if d.kind == "cuda"]
        cpu = [d for d in self._devices if d.kind == "cpu"]
        if choice == "auto":
            return (cuda or cpu or [None])[0]
        if choice == "cpu":
            return (cpu or [None])[0]
        index = int(choice.split(":")[1])
        return next((d for d in cuda if d.index == index), None)

    def _verdict(self) -> tuple[str, str]:
        if self._estimate is None:
            return "ok", ""
        device = self._target_device()
        if device is None:
            return memory_verdict(self._estimate.total_bytes, "the device", None, None)
        name = "the CPU" if device.kind == "cpu" else f"GPU {device.index} ({device.name})"
        return memory_verdict(self._estimate.total_bytes, name, device.total_bytes,
                              device.free_bytes)

    @staticmethod
    def _select(combo: QComboBox, data: str) -> None:
        index = combo.findData(data)
        if index >= 0:
            combo.setCurrentIndex(index)


def _savings(request: LoadRequest, dtype: str, chosen: Any, plain: Any) -> list[str]:
    """What quantized weights and a quantized KV cache save against the float engine in
    `dtype`, named as the user chose them."""
    lines = []
    if plain.weight_bytes > chosen.weight_bytes:
        lines.append(f"{request.weights} weights save "
                     f"{format_bytes(plain.weight_bytes - chosen.weight_bytes)} against float")
    if plain.kv_bytes > chosen.kv_bytes:
        lines.append(f"an {request.kv_cache_dtype} KV cache saves "
                     f"{format_bytes(plain.kv_bytes - chosen.kv_bytes)} against {dtype}")
    return lines


def _shipped_draft_label(name: str, spec: str) -> str:
    """A shipped draft's entry, read off the settings `spec` stands for (a label written by
    hand said 2 draft tokens where the setting drafted 3)."""
    cfg = parse_spec(spec)
    trees = f", trees of up to {cfg.num_branches} branches" if cfg.num_branches > 1 else ""
    own = f"up to {cfg.num_draft_tokens} draft tokens{trees}"
    if not cfg.lookup:
        return f"{name}, {own}"
    return f"{name}, {own}, after prompt lookup (up to {cfg.max_draft_tokens})"
