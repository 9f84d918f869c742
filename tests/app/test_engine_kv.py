"""The Engine pane's KV options with the real demo model: prefix caching, an eviction policy and
budget at load, the memory estimate under the budget, and the live KV chart receiving steps."""

from __future__ import annotations

import math

from tests.app.conftest import LOAD_TIMEOUT_MS, load_model
from tests.app.user import wait_for_estimate

REPLY_TIMEOUT_MS = 120_000


def test_kv_options_map_to_engine_arguments_and_bound_the_pool() -> None:
    from app.panes.engine.state import LoadRequest

    plain = LoadRequest("m.gguf", "cpu", "auto", 1024, 2, prefix_caching=True)
    assert plain.engine_config().prefix_caching is True
    assert plain.engine_config().kv_policy == "none" and plain.kv_tokens_per_request() == 1024
    tokens = LoadRequest("m.gguf", "cpu", "auto", 1024, 2, kv_policy="h2o", kv_budget=64)
    config = tokens.engine_config()
    assert (config.kv_policy, config.kv_budget) == ("h2o", 64)
    # Each request peaks at its budget, a block of slack and one prefill chunk.
    assert config.kv_cache_tokens == 2 * (64 + 16 + 256)
    assert config.max_num_batched_tokens == 256
    fraction = LoadRequest("m.gguf", context_tokens=2048, concurrency=1, kv_policy="streaming",
                           kv_budget=0.1)
    assert fraction.kv_tokens_per_request() == 205 + 16 + 256
    # SnapKV keeps the whole prompt until it ends, so it gets the full context.
    snap = LoadRequest("m.gguf", context_tokens=1024, concurrency=1, kv_policy="snapkv",
                       kv_budget=64)
    assert snap.kv_tokens_per_request() == 1024


def test_step_history_keeps_running_totals() -> None:
    from app.panes.engine.state import StepHistory
    from engine.llm import StepStats

    def stats(used: int, evicted: int, queries: int, hits: int) -> StepStats:
        return StepStats(1, 0, 1, 0, 0, queries, hits, 1, 0, 0, 0, used, 10, 0.01, 0.0, evicted)

    history = StepHistory(capacity=3)
    history.record(stats(2, 0, 0, 0))
    assert math.isnan(history.series().prefix_hit_rate[0])  # no look-up yet
    history.record(stats(3, 5, 32, 16))
    history.record(stats(3, 7, 32, 32))
    history.record(stats(1, 0, 0, 0))
    series = history.series()
    assert series.steps == [2, 3, 4]  # the oldest step fell out
    assert series.kv_blocks_used == [3, 3, 1]
    assert series.tokens_evicted == [5, 12, 12]
    assert series.prefix_hit_rate == [0.5, 0.75, 0.75]
    version = history.version
    history.reset()
    assert history.series().steps == [] and history.version > version


def test_kv_options_load_and_the_chart_follows_the_steps(make_window, qtbot, demo_gguf) -> None:
    from engine.kv_options import POLICIES

    window = make_window()
    pane = window.pane("engine")
    panel = pane.load_panel
    combo = panel.kv_policy_combo
    assert tuple(combo.itemData(i) for i in range(combo.count())) == POLICIES
    assert not panel.kv_budget_edit.isEnabled()  # no budget without a policy

    assert pane.picker.add_path(str(demo_gguf))
    panel.context_spin.setValue(512)
    panel.concurrency_spin.setValue(1)
    wait_for_estimate(qtbot, panel)
    full_kv = panel._estimate.kv_bytes
    combo.setCurrentIndex(combo.findData("h2o"))
    assert panel.kv_budget_edit.isEnabled()
    panel.kv_budget_edit.setText("lots")
    assert "kv_budget must be a number" in panel.estimate_label.text()
    panel.load_button.click()
    messages = [n.message for n in window.notifications.notifications()]
    assert any("kv_budget must be a number" in m for m in messages)
    assert pane.host.state == "no model"

    panel.kv_budget_edit.setText("32")
    panel.prefix_check.setChecked(True)
    # 32 tokens + a block + one 256-token prefill chunk instead of the 512-token context.
    assert panel._estimate.kv_bytes == full_kv * (32 + 16 + 256) // 512
    load_model(qtbot, window, demo_gguf, context=512, concurrency=1)
    info = pane.host.info
    assert (info.kv_policy, info.kv_budget, info.prefix_caching) == ("h2o", 32, True)
    assert "h2o eviction (budget 32)" in panel.status_label.text()
    assert info.num_kv_blocks == (32 + 16 + 256) // 16

    pane.chat.sampling.max_tokens.setValue(40)
    pane.chat.sampling.temperature.setValue(0.0)
    pane.chat.input.setPlainText("Tell me about the history of Rome.")
    with qtbot.waitSignal(pane.chat.reply_done, timeout=REPLY_TIMEOUT_MS):
        pane.chat.send_button.click()
    assert pane.chat.session.turns[-1].figures.generated_tokens == 40

    chart = pane.live_view.kv_chart
    pane.live_view.refresh()
    evicted = chart.values("tokens_evicted")
    blocks = chart.values("kv_blocks_used")
    hit_rate = chart.values("prefix_hit_rate")
    assert len(evicted) == len(blocks) == len(hit_rate) >= 40  # one point per engine step
    # The system prompt, question and 40 tokens exceed 32 tokens: the chart shows evictions,
    # as many as the engine counted.
    assert evicted[-1] == pane.host.worker._llm.evictor.tokens_evicted > 0
    assert 0 < blocks.max() <= info.num_kv_blocks
    assert all(0 <= r <= 1 for r in hit_rate if not math.isnan(r))

    with qtbot.waitSignal(pane.host.unloaded, timeout=LOAD_TIMEOUT_MS):
        panel.unload_button.click()
    pane.live_view.refresh()
    assert len(chart.values("tokens_evicted")) == 0  # a new engine starts a new chart
