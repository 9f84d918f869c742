"""The navigation rail and the contract panes follow to register into the main window."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from PySide6.QtCore import QObject, QSize, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QListWidget, QListWidgetItem, QStackedWidget, QWidget


def without_checked(slot: Callable[[], object]) -> Callable[..., None]:
    """``slot`` as a receiver of ``clicked``/``triggered`` that drops the ``checked`` flag.

    PySide hands that flag to the slot's first optional parameter (``add_server(entry=None)``
    received False): every button and action reaches its slot through here, called with no
    arguments, so an optional parameter is only ever data a caller passed on purpose."""

    def receive(*_checked: object) -> None:
        slot()

    return receive


def on_click(signal: object, slot: Callable[[], object]) -> None:
    """Connect a ``clicked`` or ``triggered`` signal to ``slot``, which is called with no
    arguments (see without_checked)."""
    signal.connect(without_checked(slot))


def make_action(parent: QObject, text: str, shortcut: object,
                slot: Callable[[], object]) -> QAction:
    """A menu action with its shortcut, calling ``slot()`` (no arguments) when triggered."""
    action = QAction(text, parent)
    action.setShortcut(QKeySequence(shortcut))
    on_click(action.triggered, slot)
    return action


def make_actions(parent: QObject, specs) -> list[QAction]:
    """Actions from (text, shortcut, slot) triples, in order."""
    return [make_action(parent, text, shortcut, slot) for text, shortcut, slot in specs]


class Pane(Protocol):
    """What a pane gives the window: an id, a title, its widget, its actions and its lifecycle."""

    pane_id: str
    title: str

    def widget(self) -> QWidget:
        """The pane's page in the window."""

    def menu_actions(self) -> list[QAction]:
        """Actions for the pane's menu, with their shortcuts."""

    def start(self) -> None:
        """Called once the window is shown: begin background work (listing, probing)."""

    def save(self) -> None:
        """Persist the pane's settings."""

    def shutdown(self) -> None:
        """Stop every thread the pane owns (flag, quit, wait)."""


class PageMixin:
    """The Pane protocol's widget() and menu_actions() for a pane that is its own page and keeps
    its menu actions in `_actions` (every pane here)."""

    _actions: list[QAction]

    def widget(self) -> QWidget:
        """The pane's page: the pane itself."""
        return self

    def menu_actions(self) -> list[QAction]:
        """The pane's menu actions, with their shortcuts."""
        return self._actions


class NavigationRail(QListWidget):
    """A vertical list of pane titles driving a stacked widget."""

    pane_selected = Signal(str)

    def __init__(self, stack: QStackedWidget, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._stack = stack
        self._ids: list[str] = []
        self.setObjectName("navigation-rail")
        self.setFixedWidth(112)
        self.setIconSize(QSize(20, 20))
        self.setSpacing(2)
        self.currentRowChanged.connect(self._on_row_changed)

    def add_pane(self, pane: Pane) -> None:
        """Add ``pane``'s page and its entry."""
        self._ids.append(pane.pane_id)
        self._stack.addWidget(pane.widget())
        item = QListWidgetItem(pane.title)
        item.setSizeHint(QSize(100, 36))
        self.addItem(item)
        if self.currentRow() < 0:
            self.setCurrentRow(0)

    def pane_ids(self) -> list[str]:
        """The registered panes, in rail order."""
        return list(self._ids)

    def select(self, pane_id: str) -> bool:
        """Show the pane ``pane_id``; False when there is none."""
        if pane_id not in self._ids:
            return False
        self.setCurrentRow(self._ids.index(pane_id))
        return True

    def current_id(self) -> str:
        """The id of the pane shown."""
        row = self.currentRow()
        return self._ids[row] if 0 <= row < len(self._ids) else ""

    def _on_row_changed(self, row: int) -> None:
        if 0 <= row < len(self._ids):
            self._stack.setCurrentIndex(row)
            self.pane_selected.emit(self._ids[row])
