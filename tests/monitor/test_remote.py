"""Scraping real servers on 127.0.0.1: vLLM-shaped text, prometheus_client's exporter, failures."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from monitor.normalize import detect_kind
from monitor.promtext import MetricsError, parse_metrics
from monitor.remote import PrometheusSource, ServerConfig, metrics_url, resolve_token

HERE = Path(__file__).parent
# Shaped after vLLM V1's /metrics (names, labels, bucket layout); values chosen for hand checks.
VLLM_A = (HERE / "vllm_metrics_a.txt").read_text()
VLLM_B = (HERE / "vllm_metrics_b.txt").read_text()
T = 1_000.0


@pytest.fixture
def text_server(serve_text):
    return serve_text(VLLM_A)


def _values(poll) -> dict[str, float]:
    return {s.series.split("/", 1)[1]: s.value for s in poll.samples}


def test_vllm_text_becomes_servescope_series(text_server):
    source = PrometheusSource(ServerConfig("vllm-a", text_server.url))
    first = _values(source.poll(T))
    assert source.status.kind == "vllm" and source.status.state == "up"
    assert first == {"requests_running": 3.0, "requests_waiting": 1.0, "kv_cache_usage": 0.25,
                     "ttft_s_count": 100.0, "prompt_tokens_total": 1000.0,
                     "generation_tokens_total": 5000.0}
    text_server.body = VLLM_B
    second = _values(source.poll(T + 2))
    # 20 new TTFT observations: 10 in (0.1, 0.25], 10 in (0.25, 0.5]; 6 s of TTFT in total.
    assert second["ttft_s_p50"] == pytest.approx(0.25)
    assert second["ttft_s_p95"] == pytest.approx(0.25 + 0.25 * 9 / 10)
    assert second["ttft_s_p99"] == pytest.approx(0.25 + 0.25 * 9.8 / 10)
    assert second["ttft_s_mean"] == pytest.approx(0.3)
    assert second["prompt_tokens_per_s"] == pytest.approx(100.0)
    assert second["generation_tokens_per_s"] == pytest.approx(1000.0)
    assert second["requests_running"] == 5.0 and second["ttft_s_count"] == 120.0
    source.close()


def test_counter_reset_after_a_restart_counts_from_zero(text_server):
    source = PrometheusSource(ServerConfig("vllm-a", text_server.url))
    text_server.body = VLLM_B
    source.poll(T)
    text_server.body = VLLM_A.replace("} 5000.0", "} 300.0")  # restarted: counters went down
    values = _values(source.poll(T + 3))
    assert values["generation_tokens_per_s"] == pytest.approx(100.0)
    # The buckets went down too, so the new counts are the window: rank 50 of 100 ends le=0.1.
    assert values["ttft_s_p50"] == pytest.approx(0.1)
    assert values["ttft_s_mean"] == pytest.approx(12.0 / 100)
    source.close()


def test_prometheus_client_exporter_with_vllm_names_is_scraped():
    registry = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", ["model_name"],
                     buckets=[0.01, 0.1, 1.0], registry=registry)
    tokens = Counter("vllm:generation_tokens", "generated", ["model_name"], registry=registry)
    running = Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        source = PrometheusSource(ServerConfig("exp", f"http://127.0.0.1:{server.server_port}"))
        source.poll(T)
        for value in (0.005, 0.05, 0.05, 0.5):
            ttft.labels("m").observe(value)
        tokens.labels("m").inc(40)
        running.labels("m").set(2)
        values = _values(source.poll(T + 4))
    finally:
        server.shutdown()
        server.server_close()
    assert source.status.kind == "vllm"
    assert values["ttft_s_count"] == 4.0
    assert values["ttft_s_p50"] == pytest.approx(0.01 + 0.09 * 1 / 2)  # rank 2 of 4
    assert values["ttft_s_mean"] == pytest.approx(0.605 / 4)
    assert values["generation_tokens_per_s"] == pytest.approx(10.0)
    assert values["requests_running"] == 2.0


def test_bearer_token_is_sent_and_a_wrong_one_reported(serve_text):
    server = serve_text(VLLM_A, token="s3cret")
    good = PrometheusSource(ServerConfig("a", server.url, token="s3cret"))
    assert good.poll(T).samples and server.auth_headers[-1] == "Bearer s3cret"
    bad = PrometheusSource(ServerConfig("b", server.url, token="wrong"))
    assert bad.poll(T).samples == []
    assert bad.status.last_error == f"{server.url}/metrics answered HTTP 401"
    assert "s3cret" not in repr(ServerConfig("a", server.url, token="s3cret"))


def test_down_server_backs_off_and_recovers(text_server):
    text_server.status = 503
    source = PrometheusSource(ServerConfig("v", text_server.url, interval_s=1.0))
    assert source.poll(T).samples == [] and source.status.state == "down"
    assert source.poll(T + 0.5).samples == []  # inside the 1 s back-off: not even tried
    requests_seen = len(text_server.auth_headers)
    source.poll(T + 1.0)                       # second failure: back-off doubles to 2 s
    assert len(text_server.auth_headers) == requests_seen + 1
    assert source.status.message == "retrying in 2 s"
    text_server.status = 200
    assert source.poll(T + 2.5).samples == []  # still backing off
    assert source.poll(T + 3.0).samples and source.status.state == "up"
    assert source.status.last_error is None
    source.close()


def test_timeout_size_limit_and_refused_connection_are_one_sentence(text_server, serve_text):
    slow = serve_text(VLLM_A, delay_s=1.0)
    src = PrometheusSource(ServerConfig("s", slow.url, timeout_s=0.2))
    src.poll(T)
    assert src.status.last_error == f"{slow.url}/metrics did not answer within 0.2 s"
    text_server.body = "x 1\n" * 100_000
    big = PrometheusSource(ServerConfig("b", text_server.url, max_bytes=64 * 1024))
    big.poll(T)
    # The server announces its length, so the body is refused before a byte of it is read.
    assert big.status.last_error == (
        f"{text_server.url}/metrics announced 0.4 MiB of metrics, more than the 0.0625 MiB cap")
    assert big.status.reason == "too_large"
    closed_port = serve_text()
    url = closed_port.url
    closed_port.close()
    gone = PrometheusSource(ServerConfig("g", url))
    gone.poll(T)
    assert gone.status.last_error.startswith(f"cannot connect to {url}/metrics")
    assert (src.status.reason, gone.status.reason) == ("timeout", "refused")


def test_json_instead_of_metrics_fails_soft(text_server):
    text_server.body = '"# HELP llamacpp:prompt_tokens_total ..."'
    source = PrometheusSource(ServerConfig("l", text_server.url))
    assert source.poll(T).samples == []
    assert "not Prometheus text" in source.status.last_error


def test_kind_detection_and_urls():
    assert detect_kind({"sglang:num_running_reqs", "python_gc_objects_collected"}) == "sglang"
    assert detect_kind({"tgi_queue_size"}) == "tgi"
    assert detect_kind({"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}) == "dcgm"
    assert detect_kind({"process_cpu_seconds_total"}) == "prometheus"
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/prometheus/metrics") == "http://h:8000/prometheus/metrics"
    with pytest.raises(ValueError, match="not an http"):
        ServerConfig("x", "ftp://h")


def test_token_references_resolve_from_the_environment(monkeypatch):
    monkeypatch.setenv("SERVESCOPE_T", "abc")
    assert resolve_token("env:SERVESCOPE_T") == "abc"
    assert resolve_token(None) is None
    with pytest.raises(ValueError, match="not set"):
        resolve_token("env:SERVESCOPE_NOPE")


def test_dcgm_text_is_split_per_gpu_and_blank_values_skipped():
    text = (
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 87\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b"} 12\n'
        "# TYPE DCGM_FI_PROF_SM_OCCUPANCY gauge\n"
        'DCGM_FI_PROF_SM_OCCUPANCY{gpu="0",UUID="GPU-a"} 0.42\n'
        "# TYPE DCGM_FI_DEV_MEMORY_TEMP gauge\n"
        'DCGM_FI_DEV_MEMORY_TEMP{gpu="0",UUID="GPU-a"} 9223372036854775794\n'
    )
    scrape = parse_metrics(text)
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in scrape.names()
    from monitor.normalize import Normalizer

    values = dict(Normalizer().update(scrape, T))
    assert values == {"gpu_util_pct[gpu=0]": 87.0, "gpu_util_pct[gpu=1]": 12.0,
                      "sm_occupancy_pct[gpu=0]": pytest.approx(42.0)}


def test_malformed_text_raises_metrics_error():
    with pytest.raises(MetricsError):
        parse_metrics("metric{unclosed=\"1 2\n")


@pytest.fixture
def hostile():
    from tests.monitor.hostile import HostileServer

    server = HostileServer()
    yield server
    server.close()


def test_a_trickling_body_is_cut_at_the_scrape_deadline(hostile):
    source = PrometheusSource(ServerConfig("s", hostile.url_for("slow"), timeout_s=0.6))
    started = time.monotonic()
    source.poll(T)
    took = time.monotonic() - started
    # httpx's own timeout bounds each read (0.5 s apart here), never the whole answer.
    assert source.status.reason == "timeout" and 0.5 < took < 1.5
    assert "did not finish its answer within 0.6 s" in source.status.last_error
    source.close()


def test_a_50_mb_body_without_a_length_stops_at_the_cap(hostile):
    source = PrometheusSource(ServerConfig("b", hostile.url_for("big"), max_bytes=2**20))
    source.poll(T)
    assert source.status.last_error == f"{hostile.url_for('big')} sent more than 1 MiB of metrics"
    assert source.status.reason == "too_large"
    source.close()


def test_invalid_utf8_and_random_bytes_fail_instead_of_storing_replacement_characters(hostile):
    for name in ("utf8", "random"):
        source = PrometheusSource(ServerConfig(name, hostile.url_for(name)))
        assert source.poll(T).samples == [] and source.status.reason == "invalid_utf8"
        assert "sent bytes that are not UTF-8 (at byte" in source.status.last_error
        source.close()


def test_non_finite_values_are_counted_and_only_them_is_down_without_back_off(serve_text):
    server = serve_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running NaN\n"
                        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting +Inf\n")
    source = PrometheusSource(ServerConfig("n", server.url))
    assert source.poll(T).samples == []
    assert (source.status.state, source.status.reason, source.status.non_finite) == (
        "down", "non_finite", 2)
    assert "sent only NaN or ±Inf values (2 samples" in source.status.last_error
    server.body += "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n"
    poll = source.poll(T + 1)  # no back-off: it answered, only its values were unusable
    assert _values(poll) == {"kv_cache_usage": 0.5} and source.status.state == "up"
    assert source.status.message.endswith("2 NaN/±Inf values skipped")
    assert (source.status.non_finite_total, source.status.scrapes,
            source.status.failed_scrapes) == (4, 2, 1)
    assert source.status.since == T + 1 and source.status.reason is None
    source.close()
