"""Journey 1, driven as a user: first start → fetch the demo model → load → chat → the reply's
line → change an option → the pane says it needs a reload → reload → the next reply uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from tests.app.conftest import LOAD_TIMEOUT_MS
from tests.app.user import button, menu_action, raw_errors

REPLY_TIMEOUT_MS = 120_000


def type_number(qtbot, spin, text: str) -> None:
    spin.setFocus()
    spin.lineEdit().selectAll()
    qtbot.keyClicks(spin, text)
    qtbot.keyClick(spin, Qt.Key.Key_Return)


def choose(combo, data: str) -> None:
    """Pick the entry whose data is ``data``, as a user picking it from the list."""
    index = combo.findData(data)
    assert index >= 0, data
    combo.setCurrentIndex(index)


def ask(qtbot, window, pane, text: str) -> str:
    """Type ``text`` in the message box, press Ctrl+Enter, wait; returns the reply's line."""
    chat = pane.chat
    chat.input.setFocus()
    qtbot.keyClicks(chat.input, text)
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=10_000)
    with qtbot.waitSignal(chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    turn = chat.session.turns[-1]
    assert turn.role == "assistant" and turn.content.strip() and turn.figures is not None
    line = turn.figures.summary()
    assert line in chat.transcript.toPlainText()
    return line


def fetch_and_load(qtbot, pane, demo_gguf: Path, before_load=lambda: None) -> None:
    """Fetch the demo model from the picker's button, choose the CPU, a short context, load."""
    panel, picker = pane.load_panel, pane.picker
    qtbot.waitUntil(lambda: not picker.is_busy())
    qtbot.mouseClick(button(pane, "Fetch demo model"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: picker.current_model() == str(demo_gguf), timeout=60_000)
    choose(panel.device_combo, "cpu")
    type_number(qtbot, panel.context_spin, "512")
    type_number(qtbot, panel.concurrency_spin, "1")
    before_load()
    with qtbot.waitSignal(pane.host.loaded, timeout=LOAD_TIMEOUT_MS):
        qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pane.host.state == "ready")


def test_journey_fetch_load_chat_change_option_reload(make_window, qtbot, demo_gguf: Path):
    window = make_window()
    pane = window.pane("engine")
    panel = pane.load_panel
    assert window.rail.current_id() == "engine"  # a first start opens on the Engine pane
    fetch_and_load(qtbot, pane, demo_gguf)
    assert not panel.reload_label.isVisible() and panel.load_button.text() == "Load"

    type_number(qtbot, pane.chat.sampling.max_tokens, "16")
    type_number(qtbot, pane.chat.sampling.temperature, "0")
    line = ask(qtbot, window, pane, "Count: one two three four five six seven")
    assert line.startswith("TTFT ") and "decode " in line and "tok/s" in line
    assert "draft" not in line  # speculative decoding is off

    # An option changed after loading: the pane says it applies on a reload.
    choose(panel.spec_combo, "ngram:k=10")
    assert panel.reload_label.isVisible()
    assert "speculative decoding" in panel.reload_label.text()
    assert panel.load_button.text() == "Reload"
    choose(panel.spec_combo, "off")  # set back: nothing to reload
    assert not panel.reload_label.isVisible() and panel.load_button.text() == "Load"
    choose(panel.spec_combo, "ngram:k=10")

    with qtbot.waitSignal(pane.host.loaded, timeout=LOAD_TIMEOUT_MS):
        qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pane.host.state == "ready")
    assert not panel.reload_label.isVisible() and panel.load_button.text() == "Load"

    # The next reply drafts with prompt lookup, and its line says how many drafts it accepted.
    type_number(qtbot, pane.chat.sampling.max_tokens, "24")
    line = ask(qtbot, window, pane, "Repeat exactly: one two three four five six seven eight "
                                    "nine ten one two three four five six seven eight nine ten")
    assert "ngram: " in line and "draft tokens accepted" in line
    # The text the accepted drafts carried is on the draft colour in the transcript.
    drafted = drafted_text(pane.chat.transcript)
    reply = pane.chat.session.turns[-1].content
    assert drafted and all(piece in reply for piece in drafted)
    assert sum(map(len, drafted)) < len(reply)  # the bonus tokens are the model's own
    assert raw_errors(window) == []


def drafted_text(transcript) -> list[str]:
    """The pieces of the transcript shown on the accepted-drafts colour."""
    from PySide6.QtGui import QColor

    from app.panes.engine.chat import DRAFTED_COLOR

    pieces, block = [], transcript.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().background().color() == QColor(DRAFTED_COLOR):
                pieces.append(fragment.text())
            it += 1
        block = block.next()
    return pieces


def test_journey_benchmark_to_history_and_planner(make_window, qtbot, demo_gguf: Path):
    window = make_window()
    pane, history = window.pane("engine"), window.pane("history")
    assert history.service.wait_for_database(30)
    panel = pane.load_panel

    def options() -> None:
        choose(panel.spec_combo, "ngram:k=10")
        if not panel.prefix_check.isChecked():
            panel.prefix_check.setFocus()
            qtbot.keyClick(panel.prefix_check, Qt.Key.Key_Space)  # the box, from the keyboard
        assert panel.prefix_check.isChecked()

    fetch_and_load(qtbot, pane, demo_gguf, options)
    # A reply prompt lookup can draft (the quick benchmark's few drafts may all be rejected,
    # or not be made at all where break-even says so: its acceptance alone is not a check).
    type_number(qtbot, pane.chat.sampling.max_tokens, "24")
    type_number(qtbot, pane.chat.sampling.temperature, "0")
    line = ask(qtbot, window, pane, "Repeat exactly: one two three four five six seven eight "
                                    "nine ten one two three four five six seven eight nine ten")
    assert "draft tokens accepted" in line

    # Run the quick benchmark from its tab; its row names the configuration it ran with.
    tabs = pane.tabs
    qtbot.mouseClick(tabs.tabBar(), Qt.MouseButton.LeftButton,
                     pos=tabs.tabBar().tabRect(tabs.indexOf(pane.bench)).center())
    assert tabs.currentWidget() is pane.bench and pane.bench.quick_box.isChecked()
    with qtbot.waitSignal(history.loaded, timeout=300_000):  # stored as a run, then listed
        qtbot.mouseClick(button(pane.bench, "Run benchmark"), Qt.MouseButton.LeftButton)
    table = pane.bench.table
    from app.panes.engine.bench import COLUMNS

    row = {c: table.item(table.rowCount() - 1, i).text() for i, c in enumerate(COLUMNS)}
    assert row["Device"] == "cpu"
    assert "float weights" in row["Configuration"] and "spec ngram:k=10" in row["Configuration"]
    assert "prefix caching" in row["Configuration"]
    assert "cannot calibrate" in pane.bench.message.text()  # a CPU run, said so
    from engine.bench import load_results

    assert load_results()[-1]["configuration"]["speculative"] == "ngram:k=10"

    # The Monitor charts the engine's speculation as vLLM's counters are charted: acceptance
    # at each draft position (the first position accepted at least as often as the second).
    window.rail.select("monitor")
    chart = window.pane("monitor").charts["spec_pos"]
    first, second = ("engine/spec_acceptance_rate_at[position=0]",
                     "engine/spec_acceptance_rate_at[position=1]")
    qtbot.waitUntil(lambda: first in chart.data and second in chart.data, timeout=15_000)
    at0, at1 = (float(chart.data[key][1][-1]) for key in (first, second))  # in %
    assert 0.0 < at0 <= 100.0 and 0.0 <= at1 <= at0
    spec = pane.host.spec_summary()
    assert spec["drafts"] > 0 and spec["accepted_per_position"][0] > 0

    # In History, beside the load tests, by kind and configuration.
    window.rail.select("history")
    runs = history.runs_table
    assert runs.rowCount() == 1
    assert runs.item(0, 1).text() == "bench"
    assert "spec ngram:k=10" in runs.item(0, 2).text()
    assert float(runs.item(0, 10).text().replace(",", "")) > 0  # output tok/s

    # The planner calibrates only where it can: a CPU benchmark is skipped, with the reason.
    window.rail.select("planner")
    menu_action(window, "Planner", "Calibrate from measured runs…").trigger()
    messages = [n.message for n in window.notifications.notifications()]
    assert any("No calibration" in m and "CPU run" in m for m in messages), messages
    assert raw_errors(window) == []


def test_journey_the_quality_canary_scores_the_loaded_model(make_window, qtbot, demo_gguf: Path):
    """Engine → Score quality canary: the bundled held-out text's perplexity from the loaded
    model's own logits, said in a notification and charted in the Monitor's quality chart; it
    equals the same text scored by a second engine of the same model and dtype. Without a
    model, the same action says to load one."""
    import math

    import torch

    from engine import LLM
    from monitor.canary import heldout_text

    window = make_window()
    pane, monitor = window.pane("engine"), window.pane("monitor")
    menu_action(window, "Engine", "Score quality canary").trigger()
    qtbot.waitUntil(lambda: any(n.message.startswith("No model is loaded: load one before "
                                                     "scoring") for n in
                                window.notifications.notifications()), timeout=10_000)
    fetch_and_load(qtbot, pane, demo_gguf)
    with qtbot.waitSignal(pane.host.canary_scored, timeout=120_000) as scored:
        menu_action(window, "Engine", "Score quality canary").trigger()
    score = scored.args[0]
    assert any(n.message.startswith(f"Quality canary: perplexity {score.perplexity:.4g} over "
                                    f"the held-out text's {score.tokens} tokens")
               for n in window.notifications.notifications())
    window.rail.select("monitor")
    chart = monitor.charts["quality"]
    qtbot.waitUntil(lambda: "engine/canary_perplexity" in chart.data, timeout=15_000)
    assert float(chart.data["engine/canary_perplexity"][1][-1]) == score.perplexity

    # The same text through a second engine of the same model and dtype, by hand.
    info = pane.host.info
    llm = LLM(str(demo_gguf), device="cpu", dtype=info.dtype, max_model_len=512)
    try:
        ids = llm.tokenizer.encode(heldout_text())
        logp = torch.log_softmax(llm.prompt_logits(ids), dim=-1)
    finally:
        llm.close()
    mean = sum(float(logp[i - 1, t]) for i, t in enumerate(ids) if i) / (len(ids) - 1)
    assert score.tokens == len(ids) - 1
    assert score.perplexity == pytest.approx(math.exp(-mean), rel=1e-3)
    assert raw_errors(window) == []
