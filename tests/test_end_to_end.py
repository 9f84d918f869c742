"""The whole loop on 127.0.0.1: `serve` with the demo model, loaded by the load generator,
watched by the monitor's Prometheus source, recorded in SQLite."""

from __future__ import annotations

import time

import httpx
import pytest

from engine import LLM
from engine.server import serve
from monitor.hub import Hub
from monitor.loadgen import LoadSpec, run_load, store_run
from monitor.promtext import parse_metrics
from monitor.remote import PrometheusSource, ServerConfig
from storage.db import open_database
from storage.queries import list_series, run_summary
from storage.writer import Writer

REQUESTS = 8


@pytest.fixture(scope="module")
def server(demo_gguf):
    llm = LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048, max_num_seqs=8)
    srv = serve(llm, "127.0.0.1", 0)
    yield srv
    srv.close()


def _ttft_count(url: str) -> float:
    scrape = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    return sum(v for _, v in scrape.values("vllm:time_to_first_token_seconds_count"))


def test_load_is_served_measured_and_recorded(server, tmp_path):
    db = open_database(f"sqlite:///{tmp_path / 'monitor.db'}")
    writer = Writer(db).start()
    source = PrometheusSource(ServerConfig(name="local", url=server.url, interval_s=0.2))
    hub = Hub([source], writer).start()
    before = _ttft_count(server.url)
    result = run_load(LoadSpec(url=server.url, concurrency=4, requests=REQUESTS, input_len=16,
                               output_len=8, seed=1))
    time.sleep(1.0)  # let the hub scrape the server once more after the last request
    hub.stop()
    assert writer.close()

    summary = result.summary
    assert summary["completed"] == REQUESTS and summary["failed"] == 0
    assert summary["ttft_ms"]["p50"] > 0 and summary["tpot_ms"]["p50"] > 0
    assert summary["output_tokens_per_s"] > 0
    # The server counted exactly the requests the load generator sent.
    assert _ttft_count(server.url) - before == REQUESTS
    assert source.status.state == "up" and source.status.kind == "servescope"
    series = list_series(db, "local")
    assert series, "the monitor stored no samples"
    run_id = store_run(db, result, name="e2e")
    assert run_summary(db, run_id)["summary"]["completed"] == REQUESTS
    db.close()
