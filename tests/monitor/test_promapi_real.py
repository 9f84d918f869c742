"""PromApiSource against a real Prometheus server (Debian's `prometheus` package) on 127.0.0.1,
scraping a vLLM-shaped /metrics served by the test; skipped, saying why, without the binary."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from monitor.hub import Hub
from monitor.promapi import PromApiSource, default_queries
from monitor.remote import ServerConfig

HERE = Path(__file__).parent
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: "
                                "apt-get install prometheus; .ci/run installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus(serve_text, tmp_path):
    """A Prometheus scraping a vLLM-shaped server every second as job "vllm-test"."""
    target = serve_text((HERE / "vllm_metrics_a.txt").read_text())
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: vllm-test\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target.server_port}']}}]\n")
    port = _free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_scrapes(url, proc, 3)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_for_scrapes(url: str, proc: subprocess.Popen, scrapes: int) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            answer = httpx.get(f"{url}/api/v1/query", params={
                "query": 'count_over_time(up{job="vllm-test"}[1m])'}).json()
            result = answer["data"]["result"]
            if result and float(result[0]["value"][1]) >= scrapes:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # still starting
        time.sleep(0.3)
    pytest.fail("prometheus did not scrape the target within 30 s")


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
