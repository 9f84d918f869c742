"""PromApiSource against a real Prometheus server (Debian's `prometheus` package) on 127.0.0.1,
scraping a vLLM-shaped /metrics served by the test; skipped, saying why, without the binary."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from monitor.hub import Hub
from monitor.promapi import PromApiSource, default_queries
from monitor.remote import ServerConfig
from tests.monitor.prometheus import (
    PROMETHEUS,
    SKIP_REASON,
    running_prometheus,
    wait_for_scrapes,
)

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=SKIP_REASON)


@pytest.fixture
def prometheus(serve_text, tmp_path):
    """A Prometheus scraping a vLLM-shaped server every second as job "vllm-test"."""
    target = serve_text((HERE / "vllm_metrics_a.txt").read_text())
    with running_prometheus(tmp_path, "vllm-test", f"127.0.0.1:{target.server_port}") as url:
        wait_for_scrapes(url, "vllm-test", 3)
        yield url


def test_a_real_prometheus_backfills_and_then_answers_each_poll(prometheus):
    source = PromApiSource(ServerConfig("fleet", prometheus), default_queries("vllm-test"),
                           backfill_s=60.0)
    hub = Hub([source])
    now = time.time()
    hub.tick(now)
    assert source.status.state == "up", source.status.last_error
    ts, running = hub.series("fleet/requests_running")
    # At least the three scrapes waited for, one point per second, then the instant value.
    assert len(ts) >= 3 and set(running.tolist()) == {3.0}
    assert ts[-1] == now and all(ts[:-1] < now) and all(ts[:-1] >= now - 60)
    assert hub.series("fleet/kv_cache_usage")[1].tolist()[-1] == 0.25
    assert hub.latest("fleet/requests_waiting") == 1.0
    # Another job's expressions find nothing: no series, and no error either.
    other = PromApiSource(ServerConfig("none", prometheus), default_queries("no-such-job"))
    assert other.poll(now).samples == [] and other.status.state == "up"
    hub.stop()
    other.close()


def test_a_real_prometheus_over_a_served_engine_gives_tpot_and_itl(demo_gguf, tmp_path):
    """Prometheus scraping a real `servescope serve` (vLLM's V1 names) through a load test: the
    fleet queries find TPOT (vLLM V1's per-request histogram) and the inter-token latency, each
    inside the bucket the server's own histograms put it in over the same requests."""
    from monitor.loadgen import LoadSpec, run_load
    from tests.monitor.sshd import shared_engine_server

    server = shared_engine_server(demo_gguf)
    with running_prometheus(tmp_path, "served", server.url.removeprefix("http://")) as url:
        summary = run_load(LoadSpec(server.url, concurrency=2, requests=6, input_len=12,
                                    output_len=8, seed=4)).summary
        time.sleep(2.5)  # two more scrapes after the last request
        source = PromApiSource(ServerConfig("fleet", url), default_queries("served"))
        values = {s.series.split("/", 1)[1]: s.value for s in source.poll(time.time()).samples}
    assert source.status.state == "up", source.status.last_error
    for name in ("tpot", "itl"):
        got = values[f"{name}_s_p50"] * 1e3
        bucket = summary["server"][f"{name}_ms"]["p50"]
        assert bucket["lo"] <= got <= (bucket["hi"] or float("inf")), (name, got, bucket)
