"""Chat playground: system prompt, replies streamed per frame, stop, regenerate, clear, copy."""

from __future__ import annotations

import dataclasses
import html

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor, QGuiApplication, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QGroupBox,
    QHBoxLayout,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.engine_host import EngineHost
from app.navigation import on_click
from app.panes.engine.sampling import SamplingControls
from app.panes.engine.state import ChatSession, ChatTurn, ReplyFigures, speculation_text
from app.settings import Settings

# ~30 Hz: streamed text is painted once per frame, never once per token.
FRAME_MS = 33
# Text from accepted draft tokens (speculative decoding) sits on this colour: a user sees where
# the drafts carried the reply and where the model went token by token.
DRAFTED_COLOR = "#2f6f4f"
DRAFTED_FORMAT = QTextCharFormat()
DRAFTED_FORMAT.setBackground(QColor(DRAFTED_COLOR))


class ChatPanel(QWidget):
    """The conversation view and its controls; the text comes from the engine host's buffer."""

    notify = Signal(str, str)
    reply_done = Signal()

    def __init__(self, host: EngineHost, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._spec_before: dict | None = None
        self._host = host
        self._settings = settings
        self.session = ChatSession()
        self.transcript = QTextBrowser(openExternalLinks=False)
        self.transcript.setPlaceholderText("Load a model, then ask something.")
        self.system_prompt = QPlainTextEdit(settings.get("chat/system_prompt"))
        self.system_prompt.setMaximumHeight(60)
        self.input = QPlainTextEdit(placeholderText="Message (Ctrl+Enter to send)")
        self.input.setMaximumHeight(80)
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.regenerate_button = QPushButton("Regenerate")
        self.clear_button = QPushButton("Clear")
        self.copy_button = QPushButton("Copy reply")
        self.sampling = SamplingControls(settings)
        self._frame = QTimer(self, interval=FRAME_MS)
        self._build()
        self._connect()
        self.set_state(host.state)

    def _build(self) -> None:
        buttons = QHBoxLayout()
        for button in (self.send_button, self.stop_button, self.regenerate_button,
                       self.clear_button, self.copy_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.transcript, 1)
        column.addWidget(self.input)
        column.addLayout(buttons)
        system = QGroupBox("System prompt")
        QVBoxLayout(system).addWidget(self.system_prompt)
        right = QWidget()
        side = QVBoxLayout(right)
        side.setContentsMargins(0, 0, 0, 0)
        side.addWidget(system)
        side.addWidget(self.sampling)
        side.addStretch(1)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(left)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 1)
        QVBoxLayout(self).addWidget(self.splitter)
        self.splitter.restoreState(self._settings.get("chat/splitter"))

    def _connect(self) -> None:
        on_click(self.send_button.clicked, self.send)
        on_click(self.stop_button.clicked, self.stop)
        on_click(self.regenerate_button.clicked, self.regenerate)
        on_click(self.clear_button.clicked, self.clear)
        on_click(self.copy_button.clicked, self.copy_reply)
        self.system_prompt.textChanged.connect(
            lambda: self._settings.set("chat/system_prompt", self.system_prompt.toPlainText()))
        self.splitter.splitterMoved.connect(
            lambda *_: self._settings.set("chat/splitter", self.splitter.saveState()))
        self._frame.timeout.connect(self._paint_frame)
        self._host.state_changed.connect(self.set_state)
        self._host.reply_finished.connect(self._on_reply_finished)
        self._host.reply_failed.connect(self._on_reply_failed)

    # ---- public API (also the targets of the window's shortcuts)
    def send(self) -> None:
        """Send the typed message and stream the reply."""
        text = self.input.toPlainText().strip()
        if not text or not self.send_button.isEnabled():
            return
        self.session.ask(text)
        self.input.clear()
        self._start()

    def regenerate(self) -> None:
        """Ask again for the last reply, with the current sampling settings."""
        if self.regenerate_button.isEnabled() and self.session.regenerate():
            self._start()

    def stop(self) -> None:
        """Stop the reply that is streaming; it keeps the text it has."""
        if self.session.streaming:
            self._host.stop_generation()

    def clear(self) -> None:
        """Forget the conversation."""
        self.session.clear()
        self._render()

    def copy_reply(self) -> None:
        """Copy the last reply to the clipboard."""
        QGuiApplication.clipboard().setText(self.session.last_reply())

    def set_state(self, state: str) -> None:
        """Enable the actions that make sense in the engine's ``state``."""
        ready = state == "ready" and not self.session.streaming
        self.send_button.setEnabled(ready)
        self.regenerate_button.setEnabled(ready and bool(self.session.last_reply()))
        self.stop_button.setEnabled(self.session.streaming)
        self.clear_button.setEnabled(not self.session.streaming)

    def save(self) -> None:
        """Persist the splitter and the sampling controls."""
        self._settings.set("chat/splitter", self.splitter.saveState())
        self.sampling.save()

    # ---- streaming
    def _start(self) -> None:
        self._spec_before = self._host.spec_summary()  # this reply's drafting is the difference
        # The open reply is still empty, so request_messages leaves it out of the prompt.
        messages = self.session.request_messages(self.system_prompt.toPlainText())
        self._render()
        self._host.generate(messages, self.sampling.values())
        self._frame.start()
        self.set_state(self._host.state)

    def _paint_frame(self) -> None:
        text, drafted = self._host.buffer.drain_marked()
        if not text:
            return
        self.session.append(text, drafted)
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        for piece, is_draft in _pieces(text, drafted):
            cursor.insertText(piece, DRAFTED_FORMAT if is_draft else QTextCharFormat())
        self.transcript.verticalScrollBar().setValue(self.transcript.verticalScrollBar().maximum())

    def _on_reply_finished(self, figures: ReplyFigures | None) -> None:
        if figures is not None:
            spec = speculation_text(self._spec_before, self._host.spec_summary())
            figures = dataclasses.replace(figures, speculative=spec)
        self._end(figures, None)

    def _on_reply_failed(self, message: str) -> None:
        self._end(None, message)
        self.notify.emit("error", message)

    def _end(self, figures: ReplyFigures | None, error: str | None) -> None:
        if not self.session.streaming:
            return
        self._frame.stop()
        self._paint_frame()  # whatever arrived after the last frame
        self.session.finish(figures, error)
        self._render()
        self.set_state(self._host.state)
        self.reply_done.emit()

    def _render(self) -> None:
        self.transcript.setHtml("".join(_turn_html(t, i == len(self.session.turns) - 1
                                                   and self.session.streaming)
                                        for i, t in enumerate(self.session.turns)))
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        self.transcript.setTextCursor(cursor)


def _pieces(text: str, drafted: list[tuple[int, int]]) -> list[tuple[str, bool]]:
    """The text cut at the drafted spans: (piece, from accepted drafts)."""
    out, at = [], 0
    for a, b in drafted:
        if a > at:
            out.append((text[at:a], False))
        out.append((text[a:b], True))
        at = b
    if at < len(text):
        out.append((text[at:], False))
    return [p for p in out if p[0]]


def _body_html(turn: ChatTurn) -> str:
    """The turn's text as HTML, accepted draft tokens' text on the draft colour."""
    parts = []
    for piece, is_draft in _pieces(turn.content, turn.drafted):
        escaped = html.escape(piece).replace("\n", "<br>")
        parts.append(f"<span style='background-color:{DRAFTED_COLOR}'>{escaped}</span>"
                     if is_draft else escaped)
    return "".join(parts)


def _turn_html(turn: ChatTurn, streaming: bool) -> str:
    who = "You" if turn.role == "user" else "Assistant"
    body = _body_html(turn)
    if streaming:
        # The streaming reply ends the document, so each frame appends at the end.
        return f"<p><b>{who}:</b> {body}"
    note = ""
    if turn.error:
        note = f"<div style='color:#e5534b'>{html.escape(turn.error)}</div>"
    elif turn.figures is not None:
        note = f"<div style='color:gray'><small>{html.escape(turn.figures.summary())}</small></div>"
    elif turn.role == "assistant":
        note = "<div style='color:gray'><small>stopped</small></div>"
    return f"<p><b>{who}:</b> {body}</p>{note}"
