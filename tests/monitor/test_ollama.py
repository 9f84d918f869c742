"""Ollama detection and /api/ps against a real HTTP server on 127.0.0.1.

The server is a fixture of the *remote* protocol: a stdlib http.server answering Ollama's
documented endpoints (GET /api/version, GET /api/ps, 404 on /metrics as Ollama's Go router does)
with the JSON shapes of its API reference; our client code runs unchanged against it.
"""

from __future__ import annotations

import json

import pytest

from monitor.ollama import NOT_PROVIDED
from monitor.remote import PrometheusSource, ServerConfig
from tests.monitor.conftest import LocalServer, QuietHandler

GIB = 2**30
# Shaped after docs/api.md "List Running Models" of ollama/ollama.
PS = {"models": [
    {"name": "llama3:8b", "model": "llama3:8b", "size": 6 * GIB, "digest": "365c0bd3c000",
     "details": {"parent_model": "", "format": "gguf", "family": "llama",
                 "families": ["llama"], "parameter_size": "8.0B",
                 "quantization_level": "Q4_0"},
     "expires_at": "2024-06-04T14:38:31.83753-07:00", "size_vram": 5 * GIB},
    {"name": "qwen2:0.5b", "model": "qwen2:0.5b", "size": 1 * GIB, "digest": "6f48b936a09f",
     "details": {"format": "gguf", "family": "qwen2", "parameter_size": "494M",
                 "quantization_level": "Q4_0"},
     "expires_at": "2024-06-04T14:40:00.0-07:00", "size_vram": 1 * GIB},
]}


class OllamaLike(LocalServer):
    """Answers Ollama's GET endpoints from `routes` (path -> body); anything else is 404."""

    def __init__(self, routes: dict[str, str]) -> None:
        super().__init__(_Handler)
        self.routes = routes
        self.paths: list[str] = []
        self.serve_in_background()


class _Handler(QuietHandler):
    server: OllamaLike

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.paths.append(self.path)
        body = self.server.routes.get(self.path)
        status, ctype = (200, "application/json") if body is not None else (404, "text/plain")
        data = (body if body is not None else "404 page not found").encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def ollama_server():
    servers: list[OllamaLike] = []

    def start(routes: dict[str, str]) -> OllamaLike:
        servers.append(OllamaLike(routes))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _values(poll) -> dict[str, float]:
    return {s.series.split("/", 1)[1]: s.value for s in poll.samples}


def test_an_ollama_server_is_detected_and_its_loaded_models_charted(ollama_server):
    server = ollama_server({"/api/version": json.dumps({"version": "0.5.7"}),
                            "/api/ps": json.dumps(PS)})
    source = PrometheusSource(ServerConfig("ol", server.url))
    status = source.test_connection()
    assert (status.kind, status.state, status.last_error) == ("ollama", "up", None)
    assert "Ollama 0.5.7" in status.message and NOT_PROVIDED in status.message
    values = _values(source.poll(1000.0))
    assert values == {"models_loaded": 2.0, "model_memory_bytes": 7.0 * GIB,
                      "model_vram_bytes": 6.0 * GIB, "model_vram_bytes[llama3:8b]": 5.0 * GIB,
                      "model_vram_bytes[qwen2:0.5b]": 1.0 * GIB}
    # Detected once: later polls read /api/ps only.
    assert server.paths == ["/metrics", "/api/version", "/api/ps", "/api/ps"]
    # Nothing loaded: Ollama sends an empty list.
    server.routes["/api/ps"] = json.dumps({"models": []})
    assert _values(source.poll(1001.0))["models_loaded"] == 0.0
    source.close()


def test_a_url_with_a_path_still_finds_ollamas_api_at_the_root(ollama_server):
    server = ollama_server({"/api/version": json.dumps({"version": "0.6.0"}),
                            "/api/ps": json.dumps(PS)})
    source = PrometheusSource(ServerConfig("ol", server.url + "/v1"))
    assert source.test_connection().kind == "ollama"
    assert "/api/version" in server.paths
    source.close()


def test_garbage_from_api_ps_marks_the_server_down_with_the_url(ollama_server):
    server = ollama_server({"/api/version": json.dumps({"version": "0.5.7"}),
                            "/api/ps": "<html>proxy error</html>"})
    source = PrometheusSource(ServerConfig("ol", server.url))
    status = source.test_connection()
    assert status.state == "down" and status.kind == "ollama"
    assert status.last_error.startswith(f"{server.url}/api/ps sent an answer that is not JSON")
    server.routes["/api/ps"] = json.dumps({"error": "unauthorized"})
    assert "without Ollama's \"models\" list" in source.test_connection().last_error
    source.close()


def test_a_404_server_that_is_not_ollama_stays_a_failed_scrape(ollama_server):
    server = ollama_server({"/api/version": json.dumps({"name": "something else"})})
    source = PrometheusSource(ServerConfig("x", server.url))
    status = source.test_connection()
    assert status.state == "down" and status.kind == "unknown"
    assert status.last_error == f"{server.url}/metrics answered HTTP 404"
    source.close()
