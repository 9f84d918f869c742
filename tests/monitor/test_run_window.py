"""A load test stores the server's own latency estimates over exactly its requests beside the
exact ones (monitor/run_window.py): against a real `servescope serve` of the demo model, and
against servers whose /metrics is missing or garbage (the load test still runs, and says why)."""

from __future__ import annotations

import httpx
import pytest

from app.panes.monitor.estimates import estimate_rows
from monitor.loadgen import LoadSpec, run_load, store_run
from monitor.promtext import parse_metrics
from monitor.quantiles import bucket_deltas, histogram_quantile, quantile_interval, sum_by_le
from monitor.run_window import ServerWindow, inside
from storage.db import open_database
from storage.queries import list_runs
from tests.app.user import shown_precision
from tests.monitor.sshd import shared_engine_server
from tests.monitor.test_loadgen import OpenAIServer, _Handler

LATENCIES = ("ttft", "tpot", "itl", "e2e")


@pytest.fixture(scope="module")
def server(demo_gguf):
    return shared_engine_server(demo_gguf)


def _ttft_buckets(url: str) -> dict[float, float]:
    scrape = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return {float(dict(labels)["le"]): value
            for labels, value in scrape.values("vllm:time_to_first_token_seconds_bucket")}


def test_the_servers_estimates_cover_exactly_the_runs_requests(server, tmp_path):
    """The server counted every request the client completed, no more; each estimate lies in
    the bucket stored with it; TTFT's equals Prometheus' histogram_quantile over the bucket
    increases between scrapes taken just outside the run; the History pane reads the stored
    estimates without any monitor having watched the server."""
    before = _ttft_buckets(server.url)
    result = run_load(LoadSpec(server.url, concurrency=3, requests=9, input_len=12,
                               output_len=6, seed=3))
    after = _ttft_buckets(server.url)
    s = result.summary
    got = s["server"]
    assert got["requests"] == s["completed"] == 9 and got["settled"]
    assert got["kind"] == "servescope" and got["version"].startswith("servescope ")
    assert got["url"] == server.url + "/metrics"
    for name in LATENCIES:  # servescope serve exports vLLM's TPOT histogram too
        assert set(got[f"{name}_ms"]) == {"p50", "p95", "p99"}, name
        for estimate in got[f"{name}_ms"].values():
            hi = estimate["hi"] if estimate["hi"] is not None else float("inf")
            assert estimate["lo"] <= estimate["estimate"] <= hi
    deltas = sum_by_le([bucket_deltas(before, after)])
    assert deltas[-1][1] == 9
    for q, p in ((0.5, "p50"), (0.99, "p99")):
        assert got["ttft_ms"][p]["estimate"] == pytest.approx(
            histogram_quantile(q, deltas) * 1e3)
        lo, hi = quantile_interval(q, deltas)
        assert (got["ttft_ms"][p]["lo"], got["ttft_ms"][p]["hi"]) == (lo * 1e3, hi * 1e3)

    db = open_database(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        store_run(db, result, name="no monitor watched this")
        run = list_runs(db)[0]
        source, rows = estimate_rows(db, run)
    finally:
        db.close()
    assert source == server.url + "/metrics"
    table = {row[0]: row[1:] for row in rows}
    exact, estimate, bucket, gap = table["TTFT p50 (ms)"]
    assert float(exact) == pytest.approx(s["ttft_ms"]["p50"], rel=1e-2)
    assert float(estimate) == pytest.approx(got["ttft_ms"]["p50"]["estimate"], rel=1e-2)
    assert bucket.endswith(" ms") and "–" in bucket
    # The cells show 4 significant digits; the gap is of the unrounded values.
    assert float(gap) == pytest.approx(float(estimate) - float(exact),
                                       abs=shown_precision(estimate, exact))
    assert len(rows) == 9  # TTFT, TPOT and ITL at p50 / p95 / p99


class _GarbageMetrics(_Handler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"<html>a proxy's login page</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("metrics", ["missing", "garbage"])
def test_a_server_without_usable_metrics_still_gets_its_load_test(metrics):
    """No /metrics (HTTP 501 from this server) or HTML in its place: the run completes, and its
    summary says in one sentence why the server's estimates are missing."""
    server = OpenAIServer()
    if metrics == "garbage":
        server.RequestHandlerClass = _GarbageMetrics
    try:
        s = run_load(LoadSpec(server.url, concurrency=2, requests=4, input_len=4,
                              output_len=3)).summary
    finally:
        server.shutdown()
        server.server_close()
    assert s["completed"] == 4
    reason = s["server"]["unavailable"]
    assert server.url + "/metrics" in reason and "\n" not in reason
    assert ("HTTP 501" in reason) if metrics == "missing" else ("not Prometheus" in reason)


def test_an_unreachable_server_is_one_sentence_and_inside_is_unknown_without_a_bucket():
    window = ServerWindow("http://127.0.0.1:9/", timeout_s=1.0)
    got = window.close(completed=0)
    assert "127.0.0.1:9" in got["unavailable"] and "Traceback" not in got["unavailable"]
    assert inside(5.0, {"estimate": 4.0, "lo": None, "hi": None}) is None
    assert inside(5.0, {"estimate": 4.0, "lo": 2.5, "hi": 5.0}) is True
    assert inside(5.1, {"estimate": 4.0, "lo": 2.5, "hi": 5.0}) is False
    assert inside(900.0, {"estimate": 250.0, "lo": 250.0, "hi": None}) is True


def test_a_run_without_its_own_estimates_is_compared_with_the_monitors(server, tmp_path):
    """A run stored without the server's estimates (older runs, --no-server-metrics) is set
    beside what the monitor recorded of the server just after it, bucket included."""
    import time

    from monitor.hub import Hub
    from monitor.remote import PrometheusSource, ServerConfig
    from storage.writer import Writer

    db = open_database(f"sqlite:///{tmp_path / 'watched.db'}")
    try:
        writer = Writer(db).start()
        hub = Hub([PrometheusSource(ServerConfig("srv", server.url, interval_s=0.1))], writer)
        hub.tick(time.time())
        result = run_load(LoadSpec(server.url, concurrency=2, requests=4, input_len=8,
                                   output_len=4, seed=5, server_estimates=False))
        assert "server" not in result.summary
        hub.tick(time.time() + 0.01)  # the monitor's first scrape after the run
        assert writer.close()
        store_run(db, result, name="srv")
        source, rows = estimate_rows(db, list_runs(db)[0])
    finally:
        db.close()
    assert source == "srv"
    table = {row[0]: row[1:] for row in rows}
    exact, estimate, bucket, _ = table["TTFT p50 (ms)"]
    assert float(exact) == pytest.approx(result.summary["ttft_ms"]["p50"], rel=1e-2)
    lo, _, hi = bucket.removesuffix(" ms").partition("–")
    assert float(lo) <= float(estimate) <= float(hi)
