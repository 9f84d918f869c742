"""The Engine pane driven with the real demo model: load, stream, stop, close mid-way, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from tests.app.conftest import LOAD_TIMEOUT_MS, load_model
from tests.app.user import wait_for_estimate

REPLY_TIMEOUT_MS = 120_000


def _send(qtbot, pane, text: str, max_tokens: int, temperature: float = 0.0) -> None:
    pane.chat.sampling.max_tokens.setValue(max_tokens)
    pane.chat.sampling.temperature.setValue(temperature)
    pane.chat.input.setPlainText(text)
    pane.chat.send_button.click()
    assert pane.chat.session.streaming


def _levels(window) -> list[tuple[str, str]]:
    return [(n.level, n.message) for n in window.notifications.notifications()]


def test_load_chat_and_figures(loaded_window, qtbot) -> None:
    window = loaded_window
    pane = window.pane("engine")
    assert window.state_label.text() == "engine: ready"
    assert window.model_label.text().startswith("model: ")
    assert window.device_label.text().startswith("device: cpu")
    assert "loaded in" in pane.load_panel.status_label.text()
    pane.chat.sampling.max_tokens.setValue(12)
    pane.chat.sampling.temperature.setValue(0.0)
    pane.chat.input.setPlainText("What is the capital of France?")
    window.activateWindow()
    qtbot.waitActive(window)
    with qtbot.waitSignal(pane.chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        # The Ctrl+Enter shortcut sends, even with the focus in the message box.
        qtbot.keyClick(pane.chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    turn = pane.chat.session.turns[-1]
    assert turn.role == "assistant" and turn.content.strip()
    figures = turn.figures
    assert figures is not None and figures.ttft_s > 0
    assert figures.prefill_tokens_per_s > 0 and figures.decode_tokens_per_s > 0
    assert 0 < figures.generated_tokens <= 12 and figures.prompt_tokens > 5
    assert "TTFT" in pane.chat.transcript.toPlainText()
    assert pane.live_view.kv_bar.maximum() == window.host.info.num_kv_blocks

    pane.chat.copy_reply()
    assert QGuiApplication.clipboard().text() == turn.content
    with qtbot.waitSignal(pane.chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        pane.chat.regenerate_button.click()
    assert [t.role for t in pane.chat.session.turns] == ["user", "assistant"]
    assert pane.chat.session.turns[-1].content == turn.content  # greedy: the same reply
    pane.chat.clear_button.click()
    assert pane.chat.transcript.toPlainText() == ""


def test_tokens_stream_in_and_stop_mid_way(loaded_window, qtbot) -> None:
    pane = loaded_window.pane("engine")
    _send(qtbot, pane, "Write a long story about a lighthouse keeper.", max_tokens=400,
          temperature=0.8)
    session = pane.chat.session
    qtbot.waitUntil(lambda: len(session.turns[-1].content) > 20, timeout=REPLY_TIMEOUT_MS)
    assert session.streaming  # text is on screen before the reply is done
    assert session.turns[-1].content[:10] in pane.chat.transcript.toPlainText()
    with qtbot.waitSignal(pane.chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        pane.chat.stop_button.click()
    turn = session.turns[-1]
    assert not session.streaming and turn.content
    if turn.figures is not None:
        assert turn.figures.finish_reason == "abort"
        assert turn.figures.generated_tokens < 400
    assert loaded_window.host.state == "ready"
    assert pane.chat.send_button.isEnabled()


def test_closing_during_generation_exits_cleanly(loaded_window, qtbot) -> None:
    window = loaded_window
    pane = window.pane("engine")
    _send(qtbot, pane, "Count from one to one thousand.", max_tokens=500)
    qtbot.waitUntil(lambda: pane.chat.session.turns[-1].content != "", timeout=REPLY_TIMEOUT_MS)
    window.close()
    assert not window.host.is_running()
    assert window.host.worker._llm is None  # released on the engine thread


def test_closing_during_loading_exits_cleanly(make_window, qtbot, demo_gguf: Path) -> None:
    window = make_window()
    pane = window.pane("engine")
    assert pane.picker.add_path(str(demo_gguf))
    pane.load_panel.load_button.click()
    assert window.host.state == "loading"
    window.close()
    assert not window.host.is_running()
    assert window.host.worker._llm is None


def test_cancel_a_load_then_load_again(make_window, qtbot, demo_gguf: Path) -> None:
    window = make_window()
    pane = window.pane("engine")
    assert pane.picker.add_path(str(demo_gguf))
    with qtbot.waitSignal(pane.host.load_cancelled, timeout=LOAD_TIMEOUT_MS):
        pane.load_panel.load_button.click()
        pane.load_panel.cancel_button.click()
        assert window.host.state == "cancelling"
    qtbot.waitUntil(lambda: window.host.state == "no model")
    assert ("info", "The load was cancelled.") in _levels(window)
    assert pane.host.info is None and pane.load_panel.load_button.isEnabled()
    load_model(qtbot, window, demo_gguf)
    assert window.host.state == "ready"


def test_corrupt_gguf_is_reported_and_the_app_stays_usable(make_window, qtbot, tmp_path: Path,
                                                           demo_gguf: Path) -> None:
    window = make_window()
    pane = window.pane("engine")
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    assert pane.picker.add_path(str(corrupt))
    with qtbot.waitSignal(pane.host.load_failed, timeout=LOAD_TIMEOUT_MS):
        pane.load_panel.load_button.click()
    qtbot.waitUntil(lambda: window.host.state == "no model")
    errors = [m for level, m in _levels(window) if level == "error"]
    assert errors and "broken.gguf" in errors[-1]
    assert "Traceback" not in errors[-1]
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    assert not pane.picker.add_path(str(not_a_model))
    assert "notes.txt" in _levels(window)[-1][1]
    load_model(qtbot, window, demo_gguf)


def test_a_model_too_large_for_the_device_is_refused(make_window, qtbot,
                                                     demo_gguf: Path) -> None:
    window = make_window()
    pane = window.pane("engine")
    panel = pane.load_panel
    qtbot.waitUntil(lambda: panel._devices != [], timeout=60_000)
    assert pane.picker.add_path(str(demo_gguf))
    panel.device_combo.setCurrentIndex(panel.device_combo.findData("cpu"))
    panel.context_spin.setValue(131072)
    panel.concurrency_spin.setValue(256)
    wait_for_estimate(qtbot, panel)
    assert "lower the context" in panel.estimate_label.text()
    panel.load_button.click()
    assert window.host.state == "no model"
    level, message = _levels(window)[-1]
    assert level == "error" and "will not fit" in message


def test_a_generation_error_is_reported(make_window, qtbot, demo_gguf: Path) -> None:
    window = make_window()
    load_model(qtbot, window, demo_gguf, context=64)
    pane = window.pane("engine")
    with qtbot.waitSignal(pane.chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        _send(qtbot, pane, "Please summarise this. " * 40, max_tokens=8)
    assert pane.chat.session.turns[-1].error
    level, message = _levels(window)[-1]
    assert level == "error" and "context" in message
    assert window.host.state == "ready" and pane.chat.send_button.isEnabled()


def test_benchmark_runs_in_the_background_and_is_saved(loaded_window, qtbot) -> None:
    from engine.bench import load_results

    pane = loaded_window.pane("engine")
    pane.bench.quick_box.setChecked(True)
    with qtbot.waitSignal(pane.host.bench_finished, timeout=300_000) as blocker:
        pane.bench.run_button.click()
        assert loaded_window.host.state == "benchmarking"
    result = blocker.args[0]
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
    assert pane.bench.table.rowCount() == 1
    assert pane.bench.table.item(0, 2).text() == "cpu"
    saved = load_results()
    assert len(saved) == 1 and saved[0]["ttft_ms"] == result["ttft_ms"]
    qtbot.waitUntil(lambda: loaded_window.host.state == "ready")


def test_unload_frees_the_model(loaded_window, qtbot) -> None:
    pane = loaded_window.pane("engine")
    with qtbot.waitSignal(pane.host.unloaded, timeout=30_000):
        pane.load_panel.unload_button.click()
    qtbot.waitUntil(lambda: loaded_window.host.state == "no model")
    assert loaded_window.model_label.text() == "model: none"
    assert not pane.chat.send_button.isEnabled()


def test_fetch_demo_model_from_the_picker(make_window, qtbot, demo_gguf: Path) -> None:
    window = make_window()
    picker = window.pane("engine").picker
    qtbot.waitUntil(lambda: not picker.is_busy())
    picker.fetch_button.click()  # already in the cache: verified and listed, no download
    qtbot.waitUntil(lambda: ("info", "The demo model is ready to load.") in _levels(window),
                    timeout=60_000)
    qtbot.waitUntil(lambda: picker.current_model() == str(demo_gguf))
    assert picker.fetch_button.isEnabled() and not picker.fetch_cancel.isVisible()


def test_cancel_the_demo_fetch(make_window, qtbot, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SERVESCOPE_CACHE_DIR", str(tmp_path / "empty-cache"))
    window = make_window()
    picker = window.pane("engine").picker
    qtbot.waitUntil(lambda: not picker.is_busy())
    picker.fetch_button.click()
    assert picker.fetch_cancel.isVisible()
    picker.fetch_cancel.click()
    qtbot.waitUntil(lambda: picker.fetch_button.isEnabled(), timeout=30_000)
    assert any(level == "info" and "cancelled" in m for level, m in _levels(window))
    assert not list((tmp_path / "empty-cache").glob("*.gguf"))


def test_speculative_toggle_drafts_and_shows_acceptance(make_window, qtbot, demo_gguf: Path):
    window = make_window()
    pane = window.pane("engine")
    combo = pane.load_panel.spec_combo
    combo.setCurrentIndex(combo.findData("ngram:k=10"))
    load_model(qtbot, window, demo_gguf)
    with qtbot.waitSignal(pane.chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        _send(qtbot, pane, "Repeat exactly: one two three four five six seven eight nine ten "
                           "one two three four five six seven eight nine ten", max_tokens=24)
    summary = pane.host.spec_summary()
    assert summary["method"] == "ngram" and summary["draft_tokens"] > 0
    pane.live_view.refresh()
    assert "accepted" in pane.live_view.spec_label.text()
    # Acceptance by draft position, charted: one bar per position, vLLM's per-position share.
    chart = pane.live_view.spec_chart
    assert chart.isVisibleTo(pane.live_view)
    heights = list(chart.bars.opts["height"])
    per_pos = summary["accepted_per_position"]
    assert len(heights) == len(per_pos) > 0 and heights[0] > 0
    assert heights == pytest.approx([n / summary["drafts"] for n in per_pos])


def test_speculative_choices_include_the_demo_drafts_and_a_draft_file(make_window, tmp_path):
    panel = make_window().pane("engine").load_panel
    combo = panel.spec_combo
    panel.set_model("smollm2-135m-instruct")
    combo.setCurrentIndex(combo.findData("demo-draft"))
    assert panel.current_request().speculative == "demo-draft"
    combo.setCurrentIndex(combo.findData("demo-medusa"))
    assert panel.current_request().speculative == "demo-medusa"
    draft = tmp_path / "draft.gguf"
    panel.set_draft_file(str(draft))
    assert panel.current_request().speculative == f"draft:{draft}"
    panel.set_draft_file(str(draft))  # chosen again: selected, not listed twice
    assert sum(combo.itemData(i) == f"draft:{draft}" for i in range(combo.count())) == 1
    # The file entry stays last, so choosing it again still opens the dialog.
    assert combo.itemData(combo.count() - 1) == "draft-file"


def test_choosing_a_model_reads_its_header_off_the_gui_thread(make_window, qtbot,
                                                               demo_gguf: Path) -> None:
    window = make_window()
    panel = window.pane("engine").load_panel
    assert window.pane("engine").picker.add_path(str(demo_gguf))
    # The pick returns at once; the estimate follows when the background read ends.
    assert "Reading SmolLM2-135M-Instruct.Q4_1.gguf's header" in panel.estimate_label.text()
    wait_for_estimate(qtbot, panel)
    assert panel.estimate_label.text().startswith("Needs about")


def test_weights_choice_shows_the_memory_saved_and_loads_int4(make_window, qtbot,
                                                              demo_gguf: Path) -> None:
    window = make_window()
    pane = window.pane("engine")
    panel = pane.load_panel
    assert pane.picker.add_path(str(demo_gguf))
    wait_for_estimate(qtbot, panel)
    assert "save" not in panel.estimate_label.text()
    panel.weights_combo.setCurrentIndex(panel.weights_combo.findData("int4"))
    assert "int4 weights save" in panel.estimate_label.text()
    load_model(qtbot, window, demo_gguf)
    assert "int4:g32 weights" in panel.status_label.text()


def test_kv_cache_dtype_choice_shows_the_memory_saved_and_loads_int8(make_window, qtbot,
                                                                     demo_gguf: Path) -> None:
    window = make_window()
    pane = window.pane("engine")
    panel = pane.load_panel
    assert pane.picker.add_path(str(demo_gguf))
    # float32 chosen (auto is bfloat16 on a CPU with bfloat16 instructions): 4 bytes a value.
    panel.dtype_combo.setCurrentIndex(panel.dtype_combo.findData("float32"))
    wait_for_estimate(qtbot, panel)
    assert "KV cache saves" not in panel.estimate_label.text()
    plain_kv = panel._estimate.kv_bytes
    panel.kv_dtype_combo.setCurrentIndex(panel.kv_dtype_combo.findData("int8"))
    assert "an int8 KV cache saves" in panel.estimate_label.text()
    head_dim = 64  # the demo model's: 64 float32 values become 64 bytes and a 4-byte scale
    assert panel._estimate.kv_bytes * 4 * head_dim == plain_kv * (head_dim + 4)
    assert panel.current_request().kv_cache_dtype == "int8"
    load_model(qtbot, window, demo_gguf)
    assert "int8 values" in panel.status_label.text()
