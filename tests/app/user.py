"""Helpers that drive the window the way a user does: menus, shortcuts, buttons, dialogs."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QAbstractButton,
    QApplication,
    QCheckBox,
    QDialog,
    QFileDialog,
    QLabel,
    QLineEdit,
    QMenu,
    QRadioButton,
    QWidget,
)

from app.workers import TaskRunner

# What a user must never read: a Python exception's type name or a traceback.
RAW_ERROR = re.compile(r"\b[A-Z][A-Za-z]+(Error|Exception)\b|Traceback \(most recent call|"
                       r"object has no attribute|is not subscriptable")


def menu_actions(window) -> list[tuple[str, QAction]]:
    """Every action of the window's menus as ("Menu › Action", action), in menu order."""
    out: list[tuple[str, QAction]] = []

    def walk(menu: QMenu, path: str) -> None:
        for action in menu.actions():
            if action.isSeparator():
                continue
            if action.menu() is not None:
                walk(action.menu(), f"{path} › {action.text()}")
            else:
                out.append((f"{path} › {action.text().replace('&', '')}", action))

    for top in window.menuBar().actions():
        if top.menu() is not None:
            walk(top.menu(), top.text().replace("&", ""))
    return out


def menu_action(window, menu: str, text: str) -> QAction:
    """The action ``text`` of the menu titled ``menu`` (ampersands and ellipses ignored)."""
    want = f"{menu} › {text}".rstrip("…")
    for label, action in menu_actions(window):
        if label.rstrip("…") == want:
            return action
    raise LookupError(f"no menu action {want!r}")


def buttons(widget: QWidget) -> list[QAbstractButton]:
    """The push and tool buttons under ``widget`` (check boxes and radio buttons are fields)."""
    return [b for b in widget.findChildren(QAbstractButton)
            if not isinstance(b, QCheckBox | QRadioButton)]


def button(widget: QWidget, text: str) -> QAbstractButton:
    """The button under ``widget`` whose text is ``text``."""
    found = [b for b in buttons(widget) if b.text().replace("&", "") == text]
    if len(found) != 1:
        raise LookupError(f"{len(found)} buttons named {text!r}")
    return found[0]


class DialogAnswerer(QObject):
    """Answers modal dialogs as they open: ``answer(dialog)`` fills and accepts one; without
    an answer each is dismissed (Escape). Records the titles it met."""

    def __init__(self, answer: Callable[[QWidget], None] | None = None) -> None:
        super().__init__()
        self.answer = answer
        self.seen: list[str] = []
        self._answering: QWidget | None = None
        self._timer = QTimer(self, interval=30)
        self._timer.timeout.connect(self._poll)
        self._timer.start()

    def _poll(self) -> None:
        modal = QApplication.activeModalWidget()
        if modal is None or not modal.isVisible():
            return
        if modal is not self._answering:
            self.seen.append(modal.windowTitle())
        if self.answer is not None and self._answering in (None, modal):
            # One answer, for the first dialog; repeated while that dialog stays open (a file
            # dialog still listing its folder may ignore the first accept).
            self._answering = modal
            self.answer(modal)
        elif isinstance(modal, QDialog):
            modal.reject()
        else:
            modal.close()

    def stop(self) -> None:
        self._timer.stop()


def answer_file_dialog(path: str) -> Callable[[QWidget], None]:
    """An answer that types ``path`` into a file dialog and accepts it."""

    def answer(dialog: QWidget) -> None:
        assert isinstance(dialog, QFileDialog), type(dialog)
        dialog.selectFile(path)
        name = dialog.findChild(QLineEdit, "fileNameEdit")
        if name is not None:
            name.setText(path)
        dialog.accept()

    return answer


def runners(window) -> list[TaskRunner]:
    """Every background task runner the window's panes (and their dialogs) own."""
    found = list(window.findChildren(TaskRunner))
    for top in QApplication.topLevelWidgets():
        if top is not window:
            found += top.findChildren(TaskRunner)
    return found


def settle(qtbot, window, patience_s: float = 3.0) -> None:
    """Let started work finish for ``patience_s``, then cancel what still runs (a long task)."""
    deadline = time.monotonic() + patience_s
    while any(r.is_running() for r in runners(window)) and time.monotonic() < deadline:
        qtbot.wait(20)
    for r in runners(window):
        if r.is_running():
            r.cancel()
    deadline = time.monotonic() + 60
    while any(r.is_running() for r in runners(window)) and time.monotonic() < deadline:
        qtbot.wait(20)
    qtbot.wait(30)  # queued results (banners) land


def close_extra_windows(window) -> None:
    """Close the non-modal dialogs an action opened (a load test window)."""
    for top in QApplication.topLevelWidgets():
        if top is not window and isinstance(top, QDialog) and top.isVisible():
            top.close()


def texts_on_screen(window) -> list[str]:
    """Every banner, status line and label a user can read in the window and its dialogs."""
    texts = [n.message for n in window.notifications.notifications()]
    texts.append(window.statusBar().currentMessage())
    tops = [window] + [t for t in QApplication.topLevelWidgets()
                       if t is not window and t.isVisible()]
    for top in tops:
        texts += [label.text() for label in top.findChildren(QLabel) if _readable(label)]
    return [t for t in texts if t]


def _readable(label: QLabel) -> bool:
    """Shown, or on a pane or tab a user can switch to; not in a closed dialog or hidden."""
    widget: QWidget | None = label
    while widget is not None:
        if widget.isHidden() and not _is_page(widget):
            return False
        widget = widget.parentWidget()
    return True


def _is_page(widget: QWidget) -> bool:
    from PySide6.QtWidgets import QStackedWidget

    parent = widget.parentWidget()
    return isinstance(parent, QStackedWidget)


def raw_errors(window) -> list[str]:
    """The texts on screen carrying raw exception text."""
    return [t for t in texts_on_screen(window) if RAW_ERROR.search(t)]


def press(qtbot, window, sequence: str) -> None:
    """Type the shortcut ``sequence`` (e.g. "Ctrl+Shift+N") into the active window."""
    from PySide6.QtGui import QKeySequence

    combo = QKeySequence(sequence)[0]
    window.activateWindow()  # a closed dialog may leave no window active; shortcuts need one
    qtbot.waitUntil(window.isActiveWindow, timeout=10_000)
    qtbot.keyClick(QApplication.focusWidget() or window, combo.key(), combo.keyboardModifiers())


def click_row(qtbot, table, row: int,
              modifier: Qt.KeyboardModifier = Qt.KeyboardModifier.NoModifier) -> None:
    """Click the first cell of ``row`` in ``table``, as a user selecting it."""
    rect = table.visualRect(table.model().index(row, 0))
    qtbot.mouseClick(table.viewport(), Qt.MouseButton.LeftButton, modifier, rect.center())


def wait_for_estimate(qtbot, panel, timeout_ms: int = 60_000) -> None:
    """Until the Engine pane's load panel shows its memory estimate (the model's header is read
    in the background)."""
    qtbot.waitUntil(lambda: "header" not in panel.estimate_label.text(), timeout=timeout_ms)


def shown_precision(*cells: str) -> float:
    """How far apart the unrounded values behind table cells (4 significant digits, the
    panes' fmt) and a figure computed from them can be: half a unit of the coarsest cell's last
    digit, for each cell, plus one for the figure's own rounding."""
    import math

    units = [10 ** (math.floor(math.log10(abs(float(c)))) - 3) for c in cells if float(c)]
    return (len(cells) + 1) * 0.5 * max(units, default=0.0)
