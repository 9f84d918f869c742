"""Servers without Prometheus metrics (TabbyAPI for ExLlamaV2, trtllm-serve, whose /metrics is
JSON, llama.cpp's server without --metrics) are watched through their OpenAI API's GET
/v1/models and measured by load tests. Each server here answers as that server's own source
does (its /metrics status or body, its model cards' `owned_by`); the completions are the load
generator tests' streaming server."""

from __future__ import annotations

import json

import pytest

from monitor.loadgen import LoadSpec, run_load
from monitor.normalize import exposes
from monitor.remote import PrometheusSource, ServerConfig
from tests.monitor.test_loadgen import OpenAIServer, _Handler

# (what GET /metrics answers: status and body, the model cards' owner, the kind expected)
SERVERS = {
    # TabbyAPI has no /metrics route (FastAPI's 404); its ModelCard says owned_by "tabbyAPI".
    "tabbyapi": (404, b'{"detail":"Not Found"}', "tabbyAPI", "tabbyapi"),
    # trtllm-serve's /metrics is a JSON list of iteration stats; owned_by "tensorrt_llm".
    "trtllm-serve": (200, b'[{"iter": 3, "numActiveRequests": 0}]', "tensorrt_llm", "trtllm"),
    # llama.cpp's server without --metrics answers 501 there; owned_by "llamacpp".
    "llama.cpp": (501, b'{"error":{"code":501,"message":"This server does not support '
                       b'metrics endpoint."}}', "llamacpp", "llamacpp"),
    # Any other OpenAI-compatible server (LM Studio's owner is its organisation).
    "other": (404, b"Not Found", "organization_owner", "openai"),
}


def _server(name: str) -> OpenAIServer:
    status, body, owner, _ = SERVERS[name]

    class Handler(_Handler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": "my-model", "object": "model", "created": 0, "owned_by": owner}]})
                    .encode())
            elif self.path == "/metrics":
                self._send(status, body)
            else:
                self._send(404, b"{}")

        def _send(self, code: int, payload: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = OpenAIServer()
    server.RequestHandlerClass = Handler
    return server


@pytest.mark.parametrize("name", list(SERVERS))
def test_a_server_without_prometheus_metrics_is_up_through_its_openai_api(name):
    server = _server(name)
    try:
        source = PrometheusSource(ServerConfig(name, server.url))
        poll = source.poll(1000.0)
        again = source.poll(1001.0)  # read through /v1/models from now on
        summary = run_load(LoadSpec(server.url, concurrency=2, requests=4, input_len=4,
                                    output_len=3)).summary
    finally:
        server.shutdown()
        server.server_close()
    status = source.status
    assert (status.state, status.kind, status.api_only) == ("up", SERVERS[name][3], True)
    assert [(s.series, s.value) for s in poll.samples] == [(f"{name}/models_served", 1.0)]
    assert [s.value for s in again.samples] == [1.0]
    assert "no Prometheus /metrics" in status.message and "load test" in status.message
    assert exposes(status.kind, status.api_only).endswith("load-test it for latencies")
    # Measured by a load test instead: every request completes, and the run says why the
    # server's own estimates are missing.
    assert summary["completed"] == 4 and summary["ttft_ms"]["p50"] > 0
    assert "no latency histograms" in summary["server"]["unavailable"]


def test_a_server_answering_neither_stays_down_with_its_metrics_error():
    """No /metrics and no model list either: down, naming the /metrics answer, as before."""
    server = OpenAIServer()  # GET answers 501 everywhere
    try:
        source = PrometheusSource(ServerConfig("neither", server.url))
        source.poll(1000.0)
    finally:
        server.shutdown()
        server.server_close()
    assert source.status.state == "down" and not source.status.api_only
    assert "/metrics answered HTTP 501" in source.status.last_error


def test_what_each_kind_exposes_comes_from_the_metric_table():
    assert "latency percentiles" in exposes("vllm") and "speculative" in exposes("vllm")
    assert "KV eviction" in exposes("servescope") and "KV eviction" not in exposes("vllm")
    assert "latency percentiles" not in exposes("llamacpp")  # counters and gauges only
    assert exposes("dcgm") == "GPU utilization, memory, power, SM occupancy"
    assert "no /metrics" in exposes("ollama")
    assert "PromQL" in exposes("prometheus-api")
