"""The monitor against real vLLM: kind and version stored, every counter it reports agreeing with
a load test's own counts, and its quantiles equal to a real Prometheus' histogram_quantile."""

from __future__ import annotations

import time

import httpx
import pytest

from monitor.drift import OutputDrift
from monitor.hub import Hub
from monitor.loadgen import LoadSpec, run_load
from monitor.remote import PrometheusSource, ServerConfig
from storage import queries
from storage.db import open_database
from storage.writer import Writer
from tests.monitor.prometheus import running_prometheus

REQUESTS = 16
HISTOGRAMS = {"ttft_s": "vllm:time_to_first_token_seconds",
              "itl_s": "vllm:inter_token_latency_seconds",
              "tpot_s": "vllm:request_time_per_output_token_seconds",
              "e2e_s": "vllm:e2e_request_latency_seconds",
              "queue_s": "vllm:request_queue_time_seconds",
              "prefill_s": "vllm:request_prefill_time_seconds",
              "decode_s": "vllm:request_decode_time_seconds"}


def _values(poll) -> dict[str, float]:
    return {s.series.split("/", 1)[1]: s.value for s in poll.samples}


def _wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the server runs and queues nothing (earlier tests' requests have all finished)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics").text
        busy = [line for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting{"))
                and float(line.rsplit(" ", 1)[1]) > 0]
        if not busy:
            return
        time.sleep(0.5)
    pytest.fail(f"vLLM at {url} stayed busy for {timeout_s:g} s")


def _load(server, **kw):
    spec = LoadSpec(url=server.url, model=server.model, requests=REQUESTS, rate=4.0,
                    input_len=24, output_len=12, seed=7, **kw)
    result = run_load(spec)
    assert result.summary["failed"] == 0, [r.error for r in result.records if not r.ok][:3]
    return result


@pytest.fixture(scope="module")
def measured(vllm_server, tmp_path_factory):
    """One load test between two monitor scrapes of the idle server (stored in SQLite)."""
    _wait_idle(vllm_server.url)
    db = open_database(f"sqlite:///{tmp_path_factory.mktemp('db') / 'm.db'}")
    writer = Writer(db).start()
    # The output-drift baseline is this load test's requests (monitor/drift.py).
    source = PrometheusSource(ServerConfig("vllm-real", vllm_server.url), window_s=3600.0,
                              drift=OutputDrift(3600.0, baseline_requests=REQUESTS,
                                                min_window_requests=REQUESTS))
    hub = Hub([source], writer)
    before_ts = time.time()
    hub.tick(before_ts)
    before = {k.split("/", 1)[1]: hub.latest(k) for k in hub.series_keys()}
    result = _load(vllm_server)
    _wait_idle(vllm_server.url)
    poll = source.poll(time.time())
    after = _values(poll)
    hub._store(poll.samples, poll.requests)
    hub._report_status(source)
    assert writer.close()
    yield {"before": before, "after": after, "result": result, "db": db, "source": source,
           "server": vllm_server}
    source.close()
    db.close()


def _increase(m: dict, series: str) -> float:
    return m["after"][series] - m["before"].get(series, 0.0)


def test_the_source_is_stored_as_vllm_with_its_version(measured):
    assert measured["source"].status.kind == "vllm"
    assert measured["source"].status.version == measured["server"].version != ""
    rows = {r["name"]: r for r in queries.list_sources(measured["db"])}
    assert rows["vllm-real"]["kind"] == "vllm"
    assert rows["vllm-real"]["version"] == measured["server"].version
    assert rows["vllm-real"]["url"] == measured["server"].url


def test_the_monitors_request_counts_equal_the_load_tests(measured):
    records = measured["result"].records
    done = len([r for r in records if r.ok])
    assert done == REQUESTS
    assert _increase(measured, "requests_finished_total") == done
    # ignore_eos with max_tokens: every request ends on its length.
    assert _increase(measured, "requests_finished_reason_total[reason=length]") == done
    assert _increase(measured, "requests_finished_reason_total[reason=stop]") == 0
    for family in HISTOGRAMS:
        if family != "itl_s":
            assert _increase(measured, f"{family}_count") == done, family
    assert _increase(measured, "generation_tokens_total") == sum(r.output_tokens for r in records)
    assert _increase(measured, "prompt_tokens_total") == sum(r.prompt_tokens for r in records)
    assert _increase(measured, "prefix_cache_queries_total") == sum(
        r.prompt_tokens for r in records)
    # One ITL observation per engine step after the first token: speculative steps emit
    # several tokens at once, so there are fewer observations than later tokens.
    steps = _increase(measured, "itl_s_count")
    assert done <= steps <= sum(r.output_tokens - 1 for r in records)


def test_vllms_response_lengths_and_finish_reasons_make_the_drift_baseline(measured):
    """vLLM's request_generation_tokens histogram (1-2-5 buckets) and finished_reason labels
    give the baseline: 12 tokens each, in the (10, 20] bucket, all ended at max_tokens."""
    after = measured["after"]
    assert after["response_length_baseline[20]"] == REQUESTS
    assert after["finish_reason_baseline[length]"] == REQUESTS
    assert not any(k.startswith("response_length_baseline[") and k != "response_length_baseline[20]"
                   for k in after)
    assert after["response_length_psi"] == after["finish_reason_psi"] == 0.0
    assert after["response_length_drift"] == 0.0


def test_the_speculative_and_prefix_cache_figures_follow_vllms_definitions(measured):
    a = measured
    drafts, drafted = _increase(a, "spec_drafts_total"), _increase(a, "spec_draft_tokens_total")
    accepted = _increase(a, "spec_accepted_tokens_total")
    assert drafts > 0 and drafted >= drafts
    assert a["after"]["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert a["after"]["spec_mean_accepted_len"] == pytest.approx(1 + accepted / drafts)
    per_pos = [_increase(a, f"spec_accepted_tokens_at_total[position={i}]") for i in range(3)]
    assert sum(per_pos) == accepted
    for i, n in enumerate(per_pos):
        assert a["after"][f"spec_acceptance_rate_at[position={i}]"] == pytest.approx(n / drafts)
    hits = _increase(a, "prefix_cache_hits_total")
    queries_ = _increase(a, "prefix_cache_queries_total")
    assert a["after"]["prefix_cache_hit_rate"] == pytest.approx(hits / queries_)
    assert _increase(a, "preemptions_total") == 0


def test_a_shared_prefix_shows_as_prefix_cache_hits(vllm_server):
    _wait_idle(vllm_server.url)
    source = PrometheusSource(ServerConfig("vllm-prefix", vllm_server.url))
    source.poll(time.time())
    prompt = "Explain, in plain words, why the sky looks blue on a clear day. " * 8
    for suffix in ("First", "Second", "Third"):
        httpx.post(vllm_server.url + "/v1/completions", timeout=120, json={
            "model": vllm_server.model, "prompt": prompt + suffix, "max_tokens": 2})
    values = _values(source.poll(time.time() + 0.5))
    source.close()
    # The 2nd and 3rd prompts reuse the first one's full KV blocks (16 tokens each).
    assert values["prefix_cache_hit_rate"] > 0.3


@pytest.fixture
def prometheus_of(vllm_server, tmp_path):
    """A real Prometheus scraping the vLLM server every second."""
    with running_prometheus(tmp_path, "vllm", vllm_server.url.split("://", 1)[1]) as url:
        _scrapes_after(url, time.time(), 2)
        yield url


def _query(url: str, expr: str, at: float) -> list[dict]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"},
                       timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _scrapes_after(url: str, since: float, n: int, timeout_s: float = 60.0) -> None:
    """Until Prometheus holds `n` scrapes of the target taken after `since`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = _query(url, 'timestamp(up{job="vllm"})', time.time())
            if result and float(result[0]["value"][1]) > since + n - 1:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    pytest.fail("prometheus did not scrape vLLM in time")


def test_the_monitors_quantiles_equal_prometheus_over_the_same_scrapes(vllm_server,
                                                                       prometheus_of):
    """Between two scrapes of the idle server, a load test: the monitor's window holds exactly
    the buckets' increase between them, which Prometheus computes from its own scrapes."""
    _wait_idle(vllm_server.url)
    _scrapes_after(prometheus_of, time.time(), 2)
    source = PrometheusSource(ServerConfig("vllm-q", vllm_server.url), window_s=3600.0)
    t0 = time.time()
    source.poll(t0)
    _load(vllm_server)
    _wait_idle(vllm_server.url)
    _scrapes_after(prometheus_of, time.time(), 1)  # Prometheus has seen the idle end state too
    values = _values(source.poll(time.time()))
    source.close()
    t1 = time.time()
    span = f"{int((t1 - t0) * 1000)}ms"  # durations take whole units
    compared = 0
    for series, family in HISTOGRAMS.items():
        for q in (0.5, 0.95, 0.99):
            expr = (f"histogram_quantile({q}, sum by (le) ({family}_bucket{{job='vllm'}} - "
                    f"{family}_bucket{{job='vllm'}} offset {span}))")
            result = _query(prometheus_of, expr, t1)
            assert result, expr
            theirs = float(result[0]["value"][1])
            assert values[f"{series}_p{round(q * 100)}"] == pytest.approx(theirs, rel=1e-9), expr
            compared += 1
    assert compared == 21


def test_prompts_in_tokens_are_exactly_their_length_on_vllm(vllm_server):
    """The load generator's token prompts (ids from vLLM's /tokenize): vLLM's own usage counts
    exactly the tokens asked for."""
    _wait_idle(vllm_server.url)
    result = run_load(LoadSpec(url=vllm_server.url, model=vllm_server.model, concurrency=2,
                               requests=4, input_len=30, output_len=4, input_unit="tokens",
                               seed=11))
    assert result.summary["failed"] == 0, result.summary.get("errors")
    assert [(r.prompt_tokens, r.output_tokens) for r in result.records] == [(30, 4)] * 4
