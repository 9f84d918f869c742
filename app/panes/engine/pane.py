"""The Engine pane: pick and load a model, chat with it, watch it, benchmark it."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QHBoxLayout, QTabWidget, QVBoxLayout, QWidget

from app.engine_host import EngineHost
from app.navigation import PageMixin, make_actions
from app.panes.engine.bench import BenchPanel
from app.panes.engine.chat import ChatPanel
from app.panes.engine.live_view import LiveView
from app.panes.engine.load_panel import LoadPanel
from app.panes.engine.model_picker import ModelPicker
from app.panes.engine.state import EngineInfo
from app.settings import Settings


class EnginePane(PageMixin, QWidget):
    """The local engine's page: model picker, load panel, live view, chat and benchmark tabs."""

    pane_id = "engine"
    title = "Engine"
    notify = Signal(str, str)

    def __init__(self, host: EngineHost, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self._settings = settings
        self.picker = ModelPicker(settings.get("engine/model"))
        self.load_panel = LoadPanel(settings)
        self.live_view = LiveView(host)
        self.chat = ChatPanel(host, settings)
        self.bench = BenchPanel(host)
        self.tabs = QTabWidget()
        self._build()
        self._connect()
        self._actions = self._make_actions()

    def _build(self) -> None:
        left = QVBoxLayout()
        left.addWidget(self.picker)
        left.addWidget(self.load_panel)
        top = QHBoxLayout()
        top.addLayout(left, 3)
        top.addWidget(self.live_view, 1, Qt.AlignmentFlag.AlignTop)
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.bench, "Benchmark")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addLayout(top)
        layout.addWidget(self.tabs, 1)

    def _connect(self) -> None:
        for source in (self.picker, self.load_panel, self.chat, self.bench):
            source.notify.connect(self.notify)
        self.picker.model_changed.connect(self._on_model_changed)
        self.load_panel.load_requested.connect(self.host.load)
        self.load_panel.cancel_requested.connect(self.host.cancel_load)
        self.load_panel.unload_requested.connect(self.host.unload)
        self.host.state_changed.connect(self.load_panel.set_state)
        self.host.state_changed.connect(lambda _state: self.live_view.refresh())
        self.host.load_progress.connect(self.load_panel.set_progress)
        self.host.loaded.connect(self._on_loaded)
        self.host.load_failed.connect(lambda message: self.notify.emit("error", message))
        self.host.load_cancelled.connect(
            lambda: self.notify.emit("info", "The load was cancelled."))
        self.host.unloaded.connect(self.live_view.refresh)
        self.host.canary_scored.connect(self._on_canary)
        self.host.canary_failed.connect(lambda message: self.notify.emit("error", message))

    def _make_actions(self) -> list[QAction]:
        specs = [
            ("Open GGUF file…", QKeySequence.StandardKey.Open, self.picker.open_file),
            ("Open Hugging Face folder…", "Ctrl+Shift+O", self.picker.open_folder),
            ("Fetch demo model", "Ctrl+Shift+D", self.picker.fetch_demo),
            ("Load model", "Ctrl+L", self.load_panel.request_load),
            ("Unload model", "Ctrl+U", self.load_panel.request_unload),
            ("Send message", "Ctrl+Return", self.chat.send),
            ("Stop generating", "Esc", self.chat.stop),
            ("Regenerate reply", "Ctrl+R", self.chat.regenerate),
            ("Copy last reply", "Ctrl+Shift+C", self.chat.copy_reply),
            ("Clear conversation", "Ctrl+Shift+K", self.chat.clear),
            ("Run benchmark", "Ctrl+B", self.bench.run),
            ("Score quality canary", "Ctrl+Alt+Q", self.host.score_canary),
        ]
        return make_actions(self, specs)

    # ---- Pane protocol
    def start(self) -> None:
        """After the window shows: list models, find devices, read earlier benchmark results."""
        self.picker.refresh()
        self.load_panel.probe_devices()
        self.bench.load_history()

    def save(self) -> None:
        """Persist the pane's controls."""
        self._settings.set("engine/model", self.picker.current_model())
        self.load_panel.save()
        self.chat.save()

    def shutdown(self) -> None:
        """Stop the pane's own background tasks; the engine thread belongs to the window."""
        self.picker.shutdown()
        self.load_panel.shutdown()

    # ---- internals
    def _on_model_changed(self, model: str) -> None:
        self.load_panel.set_model(model)
        if model:
            self._settings.set("engine/model", model)

    def _on_canary(self, score) -> None:
        self.notify.emit("info", f"Quality canary: perplexity {score.perplexity:.4g} over the "
                                 f"held-out text's {score.tokens} tokens, scored in "
                                 f"{score.elapsed_s:.1f} s (the Monitor charts it and its drift).")

    def _on_loaded(self, info: EngineInfo) -> None:
        self.load_panel.show_loaded(info)
        self.notify.emit("info", f"{info.model_name} is loaded on {info.device}.")
