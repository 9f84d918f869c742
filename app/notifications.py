"""The notifications area: non-blocking banners for errors, warnings and news the user must see."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from app.navigation import on_click
from app.theme import LEVEL_COLOURS, current_theme

LEVELS = ("error", "warning", "info")
# Info banners go away by themselves; errors and warnings stay until the user dismisses them,
# because a fallback or a failure missed in a corner is the complaint users make most.
INFO_TIMEOUT_MS = 8000
MAX_VISIBLE = 4


@dataclass
class Notification:
    """One message for the user: its level, text and when it was raised."""

    level: str
    message: str
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"unknown notification level {self.level!r}")


class _Banner(QFrame):
    """A coloured strip showing one notification with a dismiss button."""

    dismissed = Signal(object)

    def __init__(self, note: Notification, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.note = note
        self.setObjectName(f"notification-{note.level}")
        background, border = LEVEL_COLOURS[current_theme()][note.level]
        self.setStyleSheet(
            f"QFrame#{self.objectName()} {{ background: {background};"
            f" border-left: 4px solid {border}; border-radius: 3px; }}"
        )
        label = QLabel(f"<b>{note.level.capitalize()}:</b> {_escape(note.message)}")
        label.setWordWrap(True)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton(text="✕", autoRaise=True, toolTip="Dismiss")
        on_click(close.clicked, lambda: self.dismissed.emit(self))
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 6, 6)
        layout.addWidget(label, 1)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.label = label


class NotificationArea(QWidget):
    """A stack of banners above the panes; adding one never blocks or steals focus."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(8, 4, 8, 0)
        self._layout.setSpacing(4)
        self._banners: list[_Banner] = []
        self.setVisible(False)

    def notify(self, level: str, message: str) -> Notification:
        """Show ``message`` at ``level`` ("error", "warning" or "info") and return it."""
        note = Notification(level, message)
        banner = _Banner(note, self)
        banner.dismissed.connect(self._remove)
        self._banners.append(banner)
        self._layout.addWidget(banner)
        if level == "info":
            QTimer.singleShot(INFO_TIMEOUT_MS, banner, lambda: self._remove(banner))
        # Oldest first out, so a burst of errors cannot push the panes off the screen.
        while len(self._banners) > MAX_VISIBLE:
            self._remove(self._banners[0])
        self.setVisible(True)
        self.changed.emit()
        return note

    def notifications(self) -> list[Notification]:
        """The notifications on screen, oldest first."""
        return [banner.note for banner in self._banners]

    def clear(self) -> None:
        """Dismiss every notification."""
        for banner in list(self._banners):
            self._remove(banner)

    def _remove(self, banner: _Banner) -> None:
        if banner not in self._banners:
            return
        self._banners.remove(banner)
        banner.hide()
        banner.deleteLater()
        self.setVisible(bool(self._banners))
        self.changed.emit()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
