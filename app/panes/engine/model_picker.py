"""Model picker: the models the app knows, open a GGUF file or HF folder, fetch the demo model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.navigation import on_click
from app.panes.engine.state import format_bytes
from app.workers import Progress, TaskRunner, relay


def list_task(_cancel: threading.Event) -> Generator[Progress, None, list[Any]]:
    """Background task: list the models (reading GGUF headers costs too much for the GUI thread)."""
    from engine.models import list_models

    yield Progress(None, "Looking for models")
    return list_models()


def fetch_task(cancel: threading.Event) -> Generator[Progress, None, Path]:
    """Background task: fetch the demo model, reporting pip's and the extractor's progress
    (fetch_demo_model sees the cancel flag within 0.1 s and returns)."""
    from engine.models import fetch_demo_model

    def work(report: Callable[[Progress], None]) -> Path:
        return fetch_demo_model(lambda message, fraction: report(Progress(fraction, message)),
                                cancel.is_set)

    return (yield from relay(work, "servescope-fetch"))


def model_label(info: Any) -> str:
    """How a ModelInfo reads in the list: name, format, size and quantization."""
    quant = f", {info.quantization.split(',')[0]}" if info.quantization else ""
    return f"{info.name} ({info.format}, {format_bytes(info.size_bytes)}{quant})"


class ModelPicker(QGroupBox):
    """Choose the model: a list of known models, open buttons, and the demo fetch with cancel."""

    model_changed = Signal(str)
    notify = Signal(str, str)

    def __init__(self, current: str = "", parent: QWidget | None = None) -> None:
        super().__init__("Model", parent)
        self._wanted = current
        self.combo = QComboBox(minimumContentsLength=20)
        self.combo.setToolTip("Models in the cache and the ones you opened")
        self.open_file_button = QPushButton("Open GGUF…")
        self.open_folder_button = QPushButton("Open HF folder…")
        self.fetch_button = QPushButton("Fetch demo model")
        self.fetch_button.setToolTip("Download SmolLM2-135M-Instruct (94 MiB) into the model cache")
        self.fetch_cancel = QPushButton("Cancel")
        self.fetch_bar = QProgressBar()
        self.fetch_label = QLabel()
        self._lister = TaskRunner(self)
        self._fetcher = TaskRunner(self)
        self._build()
        self._connect()
        self._show_fetching(False)

    def _build(self) -> None:
        row = QHBoxLayout()
        row.addWidget(self.combo, 1)
        row.addWidget(self.open_file_button)
        row.addWidget(self.open_folder_button)
        fetch = QHBoxLayout()
        fetch.addWidget(self.fetch_button)
        fetch.addWidget(self.fetch_bar, 1)
        fetch.addWidget(self.fetch_cancel)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addLayout(fetch)
        layout.addWidget(self.fetch_label)

    def _connect(self) -> None:
        self.combo.currentIndexChanged.connect(self._on_index_changed)
        on_click(self.open_file_button.clicked, self.open_file)
        on_click(self.open_folder_button.clicked, self.open_folder)
        on_click(self.fetch_button.clicked, self.fetch_demo)
        on_click(self.fetch_cancel.clicked, self._fetcher.cancel)
        self._lister.succeeded.connect(self._on_listed)
        self._lister.failed.connect(lambda message: self.notify.emit("error", message))
        self._fetcher.progressed.connect(self._on_fetch_progress)
        self._fetcher.succeeded.connect(self._on_fetched)
        self._fetcher.failed.connect(self._on_fetch_failed)
        self._fetcher.cancelled.connect(self._on_fetch_cancelled)

    # ---- public API
    def current_model(self) -> str:
        """The chosen model's path, "" when none is chosen."""
        return self.combo.currentData() or ""

    def refresh(self) -> None:
        """List the models again in the background."""
        self._lister.start(list_task)

    def add_path(self, path: str) -> bool:
        """Remember ``path`` as a model, list it and select it; False (and an error) if unusable."""
        from engine.config import ModelError
        from engine.models import add_model_path

        try:
            info = add_model_path(path)
        except (ModelError, OSError) as exc:
            self.notify.emit("error", str(exc))
            return False
        self._wanted = str(info.path)
        self._select_or_add(info)
        return True

    def open_file(self) -> None:
        """Ask for a GGUF file and select it."""
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "",
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.add_path(path)

    def open_folder(self) -> None:
        """Ask for a Hugging Face model folder and select it."""
        path = QFileDialog.getExistingDirectory(self, "Open a Hugging Face model folder")
        if path:
            self.add_path(path)

    def fetch_demo(self) -> None:
        """Fetch the demo model in the background."""
        self._show_fetching(True)
        self.fetch_bar.setRange(0, 0)
        self.fetch_label.setText("Fetching the demo model…")
        self._fetcher.start(fetch_task)

    def is_busy(self) -> bool:
        """Whether a listing or a fetch is running."""
        return self._lister.is_running() or self._fetcher.is_running()

    def shutdown(self) -> None:
        """Stop the listing and any fetch (flag, quit, wait)."""
        self._lister.stop()
        self._fetcher.stop()

    # ---- results
    def _on_listed(self, infos: list[Any]) -> None:
        self.combo.blockSignals(True)
        self.combo.clear()
        for info in infos:
            self.combo.addItem(model_label(info), str(info.path))
        self.combo.blockSignals(False)
        index = self.combo.findData(self._wanted) if self._wanted else -1
        self.combo.setCurrentIndex(index if index >= 0 else (0 if infos else -1))
        self._on_index_changed()
        if not infos:
            self.combo.setPlaceholderText("No models yet: fetch the demo model or open one")

    def _select_or_add(self, info: Any) -> None:
        index = self.combo.findData(str(info.path))
        if index < 0:
            self.combo.addItem(model_label(info), str(info.path))
            index = self.combo.count() - 1
        self.combo.setCurrentIndex(index)

    def _on_index_changed(self, *_: object) -> None:
        model = self.current_model()
        if model:
            self._wanted = model
        self.model_changed.emit(model)

    def _on_fetch_progress(self, progress: Progress) -> None:
        if progress.fraction is None:
            self.fetch_bar.setRange(0, 0)
        else:
            self.fetch_bar.setRange(0, 1000)
            self.fetch_bar.setValue(int(progress.fraction * 1000))
        self.fetch_label.setText(progress.message[:160])

    def _on_fetched(self, path: Path) -> None:
        self._show_fetching(False)
        self.fetch_label.setText(f"Demo model ready: {path}")
        self._wanted = str(path)
        self.refresh()
        self.notify.emit("info", "The demo model is ready to load.")

    def _on_fetch_failed(self, message: str) -> None:
        self._show_fetching(False)
        self.fetch_label.setText("")
        level = "info" if "cancelled" in message else "error"
        self.notify.emit(level, message)

    def _on_fetch_cancelled(self) -> None:
        self._show_fetching(False)
        self.fetch_label.setText("")
        self.notify.emit("info", "Fetching the demo model was cancelled.")

    def _show_fetching(self, fetching: bool) -> None:
        self.fetch_button.setEnabled(not fetching)
        self.fetch_bar.setVisible(fetching)
        self.fetch_cancel.setVisible(fetching)
        self.fetch_label.setVisible(bool(self.fetch_label.text()) or fetching)
