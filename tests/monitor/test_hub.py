"""The hub with real sources: rings, writer, fuzzed metrics, alerts, cost, NVML, engine."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sequence import RequestMetrics
from monitor.alerts import AlertEvaluator, AlertRule
from monitor.cost import CostSource, cost_per_million_tokens
from monitor.engine_source import EngineSource
from monitor.hub import Hub, RingBuffer
from monitor.nvml import NvmlSource
from monitor.promtext import MetricsError, parse_metrics
from monitor.remote import PrometheusSource, ServerConfig
from monitor.types import Poll, Sample, SourceStatus
from storage import queries
from storage.db import open_database
from storage.writer import Writer


class Ramp:
    """A source whose value is its poll count, to check the order the hub keeps."""

    def __init__(self, name: str, interval_s: float = 0.0) -> None:
        self.name, self.interval_s, self.n = name, interval_s, 0
        self.status = SourceStatus(state="up")

    def poll(self, now: float) -> Poll:
        self.n += 1
        return Poll([Sample(f"{self.name}/v", now, float(self.n)),
                     Sample("intruder/v", now, -1.0)])

    def close(self) -> None:
        pass


class Broken(Ramp):
    def poll(self, now: float) -> Poll:
        raise RuntimeError("sensor fell off")


def test_ring_buffer_keeps_the_newest_points_in_order():
    ring = RingBuffer(4)
    for i in range(6):
        ring.append(float(i), i * 10.0)
    ts, values = ring.view()
    assert ts.tolist() == [2.0, 3.0, 4.0, 5.0] and values.tolist() == [20.0, 30.0, 40.0, 50.0]
    assert ring.view(since=4.0)[1].tolist() == [40.0, 50.0]


def test_hub_polls_when_due_isolates_failures_and_feeds_the_writer(tmp_path):
    db = open_database(f"sqlite:///{tmp_path / 'hub.db'}")
    writer = Writer(db).start()
    hub = Hub([Ramp("a"), Ramp("slow", interval_s=10.0), Broken("bad")], writer, capacity=3)
    for t in range(5):
        hub.tick(100.0 + t)
    assert hub.series("a/v")[1].tolist() == [3.0, 4.0, 5.0]
    assert hub.series("slow/v")[1].tolist() == [1.0]          # due again only at t=110
    assert "intruder/v" not in hub.series_keys()                    # sources write only their own
    assert hub.statuses()["bad"].last_error == "RuntimeError: sensor fell off"
    assert writer.close()
    assert queries.series_window(db, "a/v", 0, 200, "raw")[1].tolist() == [1.0, 2, 3, 4, 5]
    db.close()


def test_hub_thread_runs_and_stops():
    source = Ramp("t", interval_s=0.02)
    hub = Hub([source], tick_s=0.01).start()
    time.sleep(0.3)
    hub.stop()
    assert source.n >= 5 and len(hub.series("t/v")[0]) == source.n


def test_a_source_scraped_now_is_polled_at_once_on_its_own_thread():
    """A source due an hour from now (a quality canary) is scraped within moments of being
    asked, by its own loop; an unknown name is said, not ignored; on a hub not started the
    next tick polls it."""
    source = Ramp("canary", interval_s=3600.0)
    hub = Hub([source], tick_s=0.01).start()
    try:
        deadline = time.monotonic() + 5
        while source.n < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert source.n == 1
        asked = time.monotonic()
        assert hub.scrape_now("canary") and not hub.scrape_now("nothing")
        while source.n < 2 and time.monotonic() - asked < 5:
            time.sleep(0.01)
        assert source.n == 2 and time.monotonic() - asked < 1.0
        time.sleep(0.2)
        assert source.n == 2  # and then back on its hourly schedule
    finally:
        hub.stop()
    idle = Ramp("idle", interval_s=3600.0)
    unstarted = Hub([idle])
    unstarted.tick(100.0)
    unstarted.tick(101.0)
    assert idle.n == 1
    unstarted.scrape_now("idle")
    unstarted.tick(102.0)
    assert idle.n == 2


def test_a_failing_on_tick_is_reported_and_the_hub_thread_keeps_polling():
    calls = []

    def on_tick(hub: Hub, now: float) -> None:
        calls.append(now)
        raise ZeroDivisionError("division by zero")

    source = Ramp("t", interval_s=0.02)
    hub = Hub([source], tick_s=0.01, on_tick=on_tick).start()
    time.sleep(0.3)
    assert hub._thread.is_alive()
    hub.stop()
    assert len(calls) >= 5 and source.n >= 5  # every tick after the first failure still ran
    assert hub.tick_error == "ZeroDivisionError: division by zero"


_line = st.one_of(
    st.text(max_size=60),
    st.sampled_from(['x{le="+Inf"} 1', "# TYPE x histogram", "# TYPE y counter", "y_total -3",
                     'x_bucket{le="0.1"} NaN', 'x_bucket{le="abc"} 2', "z{a=\"b\"", "z 1 2 3",
                     "vllm:num_requests_running Inf", "\x00", "# HELP", "# EOF"]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=12))
def test_parser_and_hub_survive_malformed_exposition_text(fuzz_servers, lines):
    text = "\n".join(lines)
    with contextlib.suppress(MetricsError):  # the only exception the parser may raise
        parse_metrics(text)
    good, bad = fuzz_servers
    bad.body = text
    hub = Hub([PrometheusSource(ServerConfig("good", good.url)),
               PrometheusSource(ServerConfig("fuzz", bad.url))])
    hub.tick(1.0)
    hub.tick(3.0)
    assert hub.series("good/requests_running")[1].tolist() == [4.0, 4.0]
    assert hub.statuses()["good"].state == "up"
    hub.stop()


def test_alert_fires_after_the_duration_and_clears():
    hub = Hub()
    rule = AlertRule("ttft p99", "s/ttft", threshold=0.5, window_s=10, percentile=99, for_s=2)
    events = []
    alerts = AlertEvaluator([rule], on_event=events.append)
    for t, value in [(0, 0.1), (1, 0.9), (2, 0.9), (3, 0.9), (4, 0.9)]:
        hub._store([Sample("s/ttft", float(t), value)], [])
        alerts.evaluate(hub, float(t))
    assert [(e.state, e.ts) for e in events] == [("firing", 3.0)]  # breached from t=1, 2 s later
    assert alerts.firing == ["ttft p99"]
    assert events[0].value == pytest.approx(np.percentile([0.1, 0.9, 0.9, 0.9], 99))
    alerts.evaluate(hub, 30.0)  # the window is empty again: the breach is over
    assert [e.state for e in events] == ["firing", "cleared"] and alerts.firing == []
    with pytest.raises(ValueError):
        AlertRule("bad", "s/x", 1.0, percentile=120)


def test_cost_per_million_tokens_from_price_and_throughput():
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 3.6 M tokens per hour
    assert cost_per_million_tokens(2.0, 0.0) is None
    hub = Hub()
    hub._store([Sample("v/generation_tokens_per_s", 10.0, 500.0),
                Sample("v/generation_tokens_per_s", 11.0, 1500.0)], [])
    cost = CostSource(hub, "v", dollars_per_hour=7.2)
    assert cost.poll(11.0).samples == [Sample("v-cost/usd_per_1m_tokens", 11.0,
                                              pytest.approx(2.0))]


def test_without_a_driver_nvml_reports_zero_gpus_and_a_status_line():
    source = NvmlSource()
    if source.handles:
        pytest.skip("this machine has an NVIDIA driver; benchmarks/gpu_check.py covers it")
    assert source.poll(0.0).samples == []
    assert source.status.state == "unavailable"
    assert source.status.message.startswith("0 GPUs: NVML is not available")
    source.close()


def test_engine_source_reads_step_stats_and_finished_requests():
    stats = SimpleNamespace(num_prefill_tokens=96, num_decode_tokens=4, num_running=4,
                            num_waiting=2, num_preempted=0, num_finished=1, kv_blocks_used=30,
                            kv_blocks_total=120, wall_s=0.05, timestamp=12.5)
    engine = SimpleNamespace(last_stats=stats)
    source = EngineSource(engine)
    m = RequestMetrics(arrival=1.0, first_scheduled=1.01, first_token=1.2, finished=1.5,
                       token_times=[1.2, 1.3, 1.5], prompt_tokens=7)
    source.add_finished([SimpleNamespace(metrics=m, finish_reason="stop")])
    poll = source.poll(100.0)
    values = {s.series: s.value for s in poll.samples}
    assert values["engine/kv_cache_usage"] == 0.25
    assert values["engine/step_tokens_per_s"] == pytest.approx(2000.0)
    assert values["engine/requests_waiting"] == 2
    (record,) = poll.requests
    assert record.ttft_s == pytest.approx(0.2) and record.tpot_s == pytest.approx(0.15)
    assert record.e2e_s == pytest.approx(0.5) and record.output_tokens == 3
    assert record.itl_s == pytest.approx([0.1, 0.2])
    assert values["engine/ttft_s_p99"] == pytest.approx(0.2)  # exact, from that one request
    assert values["engine/tpot_s_p50"] == pytest.approx(0.15)
    # The same step is not reported twice; the last minute's latencies are, until it passes.
    again = {s.series for s in source.poll(101.0).samples}
    assert again == {f"engine/{m}_p{q}" for m in ("ttft_s", "tpot_s") for q in (50, 95, 99)}
    assert source.poll(161.0).samples == []


def test_engine_latency_series_are_exact_percentiles_of_the_last_minute():
    source = EngineSource(SimpleNamespace(last_stats=None))
    for i, ttft in enumerate((0.1, 0.2, 0.3, 0.4, 1.0)):
        m = RequestMetrics(arrival=0.0, first_scheduled=0.0, first_token=ttft,
                           finished=ttft + 0.1, token_times=[ttft, ttft + 0.1], prompt_tokens=4)
        source.add_finished([SimpleNamespace(metrics=m, finish_reason="stop")])
        source.poll(float(i * 20))  # requests finished at 0, 20, 40, 60 and 80 s
    values = {s.series: s.value for s in source.poll(80.0).samples}
    kept = np.array([0.2, 0.3, 0.4, 1.0])  # the one at 0 s is over a minute old
    assert values["engine/ttft_s_p50"] == pytest.approx(np.percentile(kept, 50))
    assert values["engine/ttft_s_p99"] == pytest.approx(np.percentile(kept, 99))
    assert values["engine/tpot_s_p95"] == pytest.approx(0.1)


class Hanging(Ramp):
    """A source whose poll blocks until released, like a scrape of a server that never answers."""

    def __init__(self, name: str) -> None:
        super().__init__(name, interval_s=0.02)
        self.release = threading.Event()
        self.closed = False

    def poll(self, now: float) -> Poll:
        self.release.wait(5)
        self.status.state, self.status.reason = "down", "timeout"
        self.status.last_error = "it never answered"
        return Poll()

    def close(self) -> None:
        self.closed = True


def test_a_hanging_source_delays_only_itself_and_changes_are_heard():
    heard = []
    fast, stuck = Ramp("fast", interval_s=0.02), Hanging("stuck")
    hub = Hub([fast, stuck], tick_s=0.01, stop_wait_s=0.2,
              on_status=lambda name, s: heard.append((name, s.state, s.reason))).start()
    time.sleep(0.4)
    assert fast.n >= 10  # polled on its own thread all along, the hanging one beside it
    stuck.release.set()
    time.sleep(0.1)
    assert ("stuck", "down", "timeout") in heard and ("fast", "up", None) in heard
    assert heard.count(("fast", "up", None)) == 1  # heard once, not every poll
    status = hub.statuses()["stuck"]
    status.state = "changed by a reader"  # a copy: the source's own status is untouched
    assert stuck.status.state == "down"
    stuck.release.clear()  # hangs again: stop() must not wait for it
    time.sleep(0.05)
    started = time.monotonic()
    hub.stop()
    assert time.monotonic() - started < 2.0
    assert not stuck.closed  # still polling: it closes itself when its poll returns
    stuck.release.set()
    hub._loops["stuck"].thread.join(2)
    assert stuck.closed


def test_a_removed_source_is_closed_by_its_loop_and_stores_nothing_more():
    source = Ramp("r", interval_s=0.02)
    source.closed = False
    source.close = lambda: setattr(source, "closed", True)
    hub = Hub([source], tick_s=0.01).start()
    time.sleep(0.1)
    hub.remove_source("r")
    time.sleep(0.1)
    polls = source.n
    time.sleep(0.1)
    assert source.closed and source.n == polls and "r" not in hub.statuses()
    hub.stop()


def test_engine_speculation_is_judged_over_the_last_minute_by_position():
    """The decoder's running counters become vLLM's ratios over the window: acceptance per
    draft position (accepted there / drafts), mean accepted length (1 + accepted / drafts);
    a new model's counters start a new window; no drafts, no series."""
    counters = {"drafts": 0}
    source = EngineSource(SimpleNamespace(last_stats=None), spec_summary=lambda: counters)
    assert source.poll(0.0).samples == []
    counters.update(drafts=10, draft_tokens=30, accepted_tokens=15,
                    accepted_per_position=[8, 5, 2])
    values = {s.series: s.value for s in source.poll(1.0).samples}
    assert values["engine/spec_acceptance_rate_at[position=0]"] == pytest.approx(0.8)
    assert values["engine/spec_acceptance_rate_at[position=2]"] == pytest.approx(0.2)
    assert values["engine/spec_mean_accepted_len"] == pytest.approx(2.5)
    assert values["engine/spec_acceptance_rate"] == pytest.approx(0.5)
    # 70 s later, 10 more drafts all accepted at the first position only: the window holds them.
    counters.update(drafts=20, draft_tokens=60, accepted_tokens=25,
                    accepted_per_position=[18, 5, 2])
    source.poll(40.0)
    values = {s.series: s.value for s in source.poll(71.0).samples}
    assert values["engine/spec_acceptance_rate_at[position=0]"] == pytest.approx(1.0)
    assert values["engine/spec_acceptance_rate_at[position=1]"] == pytest.approx(0.0)
    # A new model: counters from zero again, judged alone.
    counters.update(drafts=2, draft_tokens=6, accepted_tokens=1, accepted_per_position=[1, 0, 0])
    values = {s.series: s.value for s in source.poll(72.0).samples}
    assert values["engine/spec_acceptance_rate_at[position=0]"] == pytest.approx(0.5)


def test_the_first_drafts_stay_in_the_window_after_the_next_poll():
    """Counters seen at zero are the window's base: drafts accepted before the first poll that
    saw them still count a poll later, when the drafts since were all rejected (a quick
    benchmark whose matches came early charted 0% at the first position)."""
    counters = {"drafts": 0}
    source = EngineSource(SimpleNamespace(last_stats=None), spec_summary=lambda: counters)
    assert source.poll(0.0).samples == []
    counters.update(drafts=5, draft_tokens=25, accepted_tokens=7, accepted_per_position=[5, 2])
    source.poll(0.5)
    counters.update(drafts=8, draft_tokens=40, accepted_tokens=7, accepted_per_position=[5, 2])
    values = {s.series: s.value for s in source.poll(1.0).samples}
    assert values["engine/spec_acceptance_rate_at[position=0]"] == pytest.approx(5 / 8)
    assert values["engine/spec_acceptance_rate_at[position=1]"] == pytest.approx(2 / 8)
    assert values["engine/spec_acceptance_rate"] == pytest.approx(7 / 40)
