"""Output drift (monitor/drift.py) from outside: a real `servescope serve` of the demo model (the
session's shared one) driven by the load generator, scraped by the monitor's PrometheusSource;
its response lengths and finish reasons judged against the first requests, and the baseline kept
across sessions by the Monitor's service. Plus the statistic itself: no alarm from sampling
noise, an alarm from a real shift."""

from __future__ import annotations

import math
import random
import time

import httpx
import pytest

from monitor.drift import (
    PSI_SIGNIFICANT,
    OutputDrift,
    bucket_counts,
    chi2_quantile_99,
    drift_rules,
    noise_bar,
    psi,
    stored_baselines,
)
from monitor.loadgen import LoadSpec, run_load
from monitor.promtext import parse_metrics
from monitor.remote import PrometheusSource, ServerConfig
from tests.monitor.conftest import monitor_session

BASE = {"a": 40, "b": 30, "c": 15, "d": 10, "e": 5}


@pytest.fixture(scope="module")
def server(demo_gguf):
    """A server of this module's own: the drift test counts every request the server finishes,
    and a canary score another module's recording left in flight on the shared server once
    landed in its baseline (25 requests where 24 were sent)."""
    from engine import LLM
    from engine.server import serve

    srv = serve(LLM(str(demo_gguf), device="cpu", kv_cache_tokens=1024, dtype="float32"),
                "127.0.0.1", 0)
    yield srv
    srv.close()


# ---- the statistic
def test_psi_is_zero_for_the_same_distribution_and_grows_with_the_shift():
    assert psi(BASE, dict(BASE)) == 0.0
    # Twice the requests in the same shares: all but zero (the half-count smoothing weighs less).
    assert psi(BASE, {k: 2 * v for k, v in BASE.items()}) < 1e-3
    small = psi(BASE, {"a": 35, "b": 30, "c": 20, "d": 10, "e": 5})
    large = psi(BASE, {"a": 5, "b": 10, "c": 15, "d": 30, "e": 40})
    assert 0 < small < 0.05 < PSI_SIGNIFICANT < large
    # By hand, smoothed by half a count: sum (q - p) ln(q / p).
    p, q = (40.5 / 101, 60.5 / 101), (60.5 / 101, 40.5 / 101)
    expected = sum((b - a) * math.log(b / a) for a, b in zip(p, q, strict=True))
    assert psi({"x": 40, "y": 60}, {"x": 60, "y": 40}) == pytest.approx(expected, rel=1e-12)


def test_the_chi_square_quantile_is_close_to_the_tables():
    # The 99th percentiles from the tables (df 2, 4, 9, 20).
    for df, table in ((2, 9.2103), (4, 13.2767), (9, 21.6660), (20, 37.5662)):
        assert chi2_quantile_99(df) == pytest.approx(table, rel=0.01)


def _window(rng: random.Random, shares: dict, n: int) -> dict:
    out: dict = {}
    for key in rng.choices(list(shares), list(shares.values()), k=n):
        out[key] = out.get(key, 0) + 1
    return out


def test_sampling_noise_alone_rarely_crosses_the_bar_and_a_real_shift_does():
    """Windows of 20 requests drawn from the baseline's own distribution: a plain PSI > 0.25
    rule alarms on many of them; the noise bar on at most 1%. A real shift crosses it."""
    rng = random.Random(7)
    nulls = [_window(rng, BASE, 20) for _ in range(1000)]
    plain = sum(psi(BASE, w) > PSI_SIGNIFICANT for w in nulls) / len(nulls)
    barred = sum(psi(BASE, w) > max(PSI_SIGNIFICANT, noise_bar(BASE, w)) for w in nulls) / 1000
    assert plain > 0.05 and barred <= 0.01
    shifted = {"a": 5, "b": 10, "c": 15, "d": 30, "e": 40}
    hits = [_window(rng, shifted, 20) for _ in range(200)]
    assert sum(psi(BASE, w) > max(PSI_SIGNIFICANT, noise_bar(BASE, w)) for w in hits) >= 190


def test_bucket_counts_turn_cumulative_buckets_into_per_bucket_counts():
    assert bucket_counts([(1.0, 0.0), (2.0, 1.0), (5.0, 4.0), (float("inf"), 6.0)]) == \
        {"1": 0.0, "2": 1.0, "5": 3.0, "inf": 2.0}


def test_a_baseline_is_learnt_from_the_first_requests_then_stored_and_read_back():
    drift = OutputDrift(window_s=10, baseline_requests=10, min_window_requests=5)
    assert drift.observe("finish_reason", {"length": 6}, 1.0) == []  # 6 of 10: still learning
    out = dict(drift.observe("finish_reason", {"length": 3, "stop": 1}, 2.0))
    assert out["finish_reason_baseline[length]"] == 9 and out["finish_reason_baseline[stop]"] == 1
    assert out["finish_reason_psi"] == pytest.approx(0.0, abs=1e-12)  # the window is the baseline
    stored = stored_baselines([(k, v) for k, v in out.items() if "_baseline[" in k])
    again = OutputDrift(window_s=10, baselines=stored, min_window_requests=5)
    assert again.baseline("finish_reason") == {"length": 9, "stop": 1}
    # Judged from its first window on: no second baseline to learn.
    judged = dict(again.observe("finish_reason", {"stop": 5}, 1.0))
    assert judged["finish_reason_drift"] > 1 and "finish_reason_baseline[stop]" not in judged


def test_every_server_gets_a_drift_rule_per_distribution():
    names = sorted(r.series for r in drift_rules(["a", "b"]))
    assert names == ["a/finish_reason_drift", "a/response_length_drift",
                     "b/finish_reason_drift", "b/response_length_drift"]


# ---- against the real server
def _load(server, output_len: int, requests: int) -> None:
    result = run_load(LoadSpec(url=server.url, concurrency=8, requests=requests, input_len=8,
                               output_len=output_len, seed=output_len))
    assert result.summary["failed"] == 0


def _scrape(source: PrometheusSource, t: float) -> dict[str, float]:
    poll = source.poll(t)
    assert source.status.state == "up", source.status
    return {s.series.removeprefix("srv/"): s.value for s in poll.samples}


def _histogram_counts(server, name: str) -> dict[str, float]:
    scrape = parse_metrics(httpx.get(server.url + "/metrics").text)
    return {dict(labels)["le"]: v for labels, v in scrape.values(name + "_bucket")}


def test_a_servers_response_lengths_and_finish_reasons_drift_from_its_first_requests(server):
    """Baseline: 24 requests of 2 tokens (finish: length). Then 16 of 30 tokens: the response
    lengths drift, the finish reasons do not; then 12 cut short by a stop string: they do."""
    before = _histogram_counts(server, "vllm:request_generation_tokens")
    # Scrapes 1 s apart (as the test says) and a drift window shorter than that: each scrape's
    # requests are judged alone against the baseline.
    source = PrometheusSource(ServerConfig("srv", server.url, interval_s=0.01),
                              drift=OutputDrift(window_s=0.5, baseline_requests=24,
                                                min_window_requests=10))
    try:
        t = 0.0
        _scrape(source, t)
        _load(server, output_len=2, requests=24)
        first = _scrape(source, t := t + 1)
        assert first["response_length_baseline[2]"] == 24  # exactly the requests sent
        assert first["finish_reason_baseline[length]"] == 24
        assert first["response_length_psi"] == pytest.approx(0.0, abs=1e-12)
        # /metrics' own histogram counts them in vLLM's 1-2-5 buckets.
        after = _histogram_counts(server, "vllm:request_generation_tokens")
        assert after["2.0"] - before.get("2.0", 0) == 24 and after["1.0"] == before.get("1.0", 0)

        _load(server, output_len=30, requests=16)
        longer = _scrape(source, t := t + 1)
        assert longer["response_length_psi"] > PSI_SIGNIFICANT
        assert longer["response_length_drift"] > 1.0
        assert longer["finish_reason_drift"] < 1.0  # all still ended at max_tokens

        with httpx.Client(timeout=60) as client:
            for i in range(12):
                reply = client.post(server.url + "/v1/completions", json={
                    "prompt": f"Count with me: {i}", "max_tokens": 30, "stop": [" "],
                    "temperature": 0})
                assert reply.status_code == 200, reply.text
        stopped = _scrape(source, t := t + 1)
        assert stopped["finish_reason_drift"] > 1.0
    finally:
        source.close()


def test_the_monitor_keeps_a_servers_drift_baseline_across_sessions(server, tmp_path):
    """The Monitor's service (no window): the first session learns the baseline from the
    server's first 100 requests and stores it; the next session on the same database judges
    the first 20 requests it sees against it, without learning a new one."""
    from app.panes.monitor.state import ServerEntry

    db_url = f"sqlite:///{tmp_path / 'monitor.db'}"

    def session(requests: int, want: str) -> list[float]:
        with monitor_session(db_url, ServerEntry("drifty", server.url)) as service:
            _wait(lambda: len(service.hub.series("drifty/requests_running")[1]) >= 2)
            _load(server, output_len=2, requests=requests)
            _wait(lambda: len(service.hub.series(want)[1]) >= 1)
            return list(service.hub.series(want)[1])

    learnt = session(100, "drifty/response_length_baseline[2]")
    assert learnt == [100]
    judged = session(20, "drifty/response_length_psi")
    assert judged[0] == pytest.approx(0.0, abs=1e-9)  # the same lengths as the baseline's


def _wait(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_servescope_record_keeps_a_servers_drift_baseline_across_runs(server, tmp_path):
    """`servescope record` as the Monitor pane: the first run learns the baseline from the
    server's first 100 requests and stores it; the next run on the same database judges its
    first 20 requests against it, without learning a new one."""
    import os
    import signal
    import subprocess
    import sys

    from storage import queries
    from storage.db import StorageError, open_database

    db_url = f"sqlite:///{tmp_path / 'record.db'}"

    def stored(key: str) -> list[float]:
        if not (tmp_path / "record.db").exists():
            return []
        try:
            db = open_database(db_url)
        except StorageError:  # the recorder is still making its tables
            return []
        try:
            return queries.series_window(db, key, 0, 2e10, "raw")[1].tolist()
        finally:
            db.close()

    def run(requests: int, want: str, stop: signal.Signals) -> list[float]:
        # This run's samples, not the last one's: the load starts once it scrapes, and what it
        # waits for is a value stored after those the database already holds.
        before, wanted = len(stored("drifty/requests_running")), len(stored(want))
        proc = subprocess.Popen(
            [sys.executable, "-m", "monitor.cli", "record", "--db", db_url, "--server",
             f"drifty={server.url}", "--interval", "0.2"],
            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        try:
            _wait(lambda: len(stored("drifty/requests_running")) >= before + 2)
            _load(server, output_len=2, requests=requests)
            _wait(lambda: len(stored(want)) > wanted)
        finally:
            proc.send_signal(stop)
            try:
                # A liveness bound, not a timing: on a loaded CI runner stopping the recorder
                # (writing what is pending, joining its threads) once took over 60 s.
                _, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # every thread's stack, on its stderr
                try:
                    _, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    _, err = proc.communicate()
                pytest.fail(f"servescope record did not stop within 180 s of {stop.name}: "
                            f"{err}")
        assert proc.returncode == 0, err
        return stored(want)[wanted:]

    assert run(100, "drifty/response_length_baseline[2]", signal.SIGINT) == [100]
    # Stopped as `docker stop` or systemd stops it: what it recorded is written all the same.
    judged = run(20, "drifty/response_length_psi", signal.SIGTERM)
    assert judged[0] == pytest.approx(0.0, abs=1e-9)  # the same lengths as the baseline's
    assert stored("drifty/response_length_baseline[2]") == [100]  # none learnt the second time
