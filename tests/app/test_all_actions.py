"""Every menu action and every enabled button of every pane, triggered in turn, as a user would."""

from __future__ import annotations

import re
from pathlib import Path

from tests.app.user import (
    DialogAnswerer,
    buttons,
    close_extra_windows,
    menu_actions,
    raw_errors,
    settle,
)

APP = Path(__file__).resolve().parents[2] / "app"
LAST = ("File › Quit",)  # closes the window: triggered after everything else


def test_no_button_or_action_connects_its_slot_directly():
    """The whole `checked`-flag class: clicked/triggered reach slots only through on_click,
    which calls them with no arguments (PySide passed the flag into `entry=None`)."""
    direct = re.compile(r"\.(clicked|triggered)\.connect\(")
    offenders = [f"{path.relative_to(APP.parent)}:{n}"
                 for path in APP.rglob("*.py") if path.name != "navigation.py"
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if direct.search(line)]
    assert offenders == []


def _with_something_selected(window) -> None:
    """A server and two runs selected before each step, so Edit, Remove, Test connection,
    Load test and Compare act on something instead of returning at once."""
    from PySide6.QtCore import QItemSelectionModel

    from app.panes.monitor.state import ServerEntry

    servers, history = window.pane("servers"), window.pane("history")
    if "probe" not in servers.service.servers:
        servers.add_server(ServerEntry("probe", "http://127.0.0.1:9"))  # nothing listens
    servers.select("probe")
    model = history.runs_table.selectionModel()
    flags = (QItemSelectionModel.SelectionFlag.Select
             | QItemSelectionModel.SelectionFlag.Rows)
    for row in range(min(2, history.runs_table.rowCount())):
        model.select(history.runs_table.model().index(row, 0), flags)


def _exercise(qtbot, window, label: str, fire, exceptions, problems: list[str]) -> None:
    before = len(exceptions)
    _with_something_selected(window)
    fire()
    settle(qtbot, window)
    close_extra_windows(window)
    for exc in exceptions[before:]:
        problems.append(f"{label}: raised {exc[0].__name__}: {exc[1]}")
    for text in raw_errors(window):
        problems.append(f"{label}: shows {text!r}")
    window.notifications.clear()  # the next step's banners are its own


def test_every_action_and_button_raises_nothing_and_shows_no_raw_error(
        make_window, qtbot, demo_gguf, capsys):
    from storage.db import open_database
    from storage.queries import save_run

    db = open_database(None)  # two stored runs for History's buttons
    for name in ("first", "second"):
        save_run(db, "loadtest", name, {}, {"completed": 2, "failed": 0}, 1.7e9, 1.7e9 + 5)
    db.close()
    window = make_window()
    settle(qtbot, window, patience_s=20)  # the start-up search and database opening
    assert window.pane("servers").service.wait_for_database(30)
    history = window.pane("history")
    for _ in range(15):  # settle() may have cancelled the first listing: list again
        if history.runs_table.rowCount() == 2:
            break
        history.reload()
        qtbot.wait(2000)
    assert history.runs_table.rowCount() == 2
    answerer = DialogAnswerer()
    problems: list[str] = []
    fired_actions, fired_buttons = 0, 0
    with qtbot.captureExceptions() as exceptions:
        actions = menu_actions(window)
        for label, action in actions:
            if label in LAST:
                continue
            _exercise(qtbot, window, label, action.trigger, exceptions, problems)
            fired_actions += 1
        for pane in window.panes:
            window.rail.select(pane.pane_id)
            for b in buttons(pane.widget()):
                if not b.isEnabled() or not b.text():
                    continue
                label = f"{pane.title} pane › button {b.text()!r}"
                _exercise(qtbot, window, label, b.click, exceptions, problems)
                fired_buttons += 1
                if b.isCheckable() and b.isChecked():  # put a toggle (Pause) back
                    b.click()
                    settle(qtbot, window)
        for label, action in actions:
            if label in LAST:
                _exercise(qtbot, window, label, action.trigger, exceptions, problems)
                fired_actions += 1
    answerer.stop()
    assert problems == [], "\n".join(problems)
    assert not window.isVisible()  # Quit closed it
    with capsys.disabled():
        print(f"\nall-actions: {fired_actions} actions and {fired_buttons} buttons exercised; "
              f"dialogs dismissed: {len(answerer.seen)}")
    assert fired_actions >= 38 and fired_buttons >= 20


def test_a_task_that_fails_unexpectedly_reports_a_sentence(qtbot):
    """A bug in a background task reaches the user as a sentence, never `TypeError: ...`."""
    from app.workers import TaskRunner

    def task(_cancel):
        yield from ()
        flag = bool(_cancel.is_set())
        return flag[0]  # 'bool' object is not subscriptable, the bug issue 14 met

    runner = TaskRunner()
    with qtbot.waitSignal(runner.failed, timeout=5000) as blocker:
        runner.start(task)
    runner.stop()
    message = blocker.args[0]
    assert message.startswith("Something went wrong: ") and message.endswith("report this.")
    assert "TypeError" not in message and "Traceback" not in message
