"""Fixtures: small real HTTP servers on 127.0.0.1 for the monitor tests (no mocks of clients)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest


@contextlib.contextmanager
def monitor_session(db_url: str, entry):
    """The Monitor's service (no window) on `db_url`, watching the server `entry` (saved on
    first use); shut down afterwards, having reported no error."""
    from app.panes.monitor.service import MonitorService

    errors: list[str] = []
    service = MonitorService(on_error=errors.append, gpus=False, db_url=db_url)
    service.start()
    try:
        assert service.wait_for_database(30), errors
        if entry.name not in service.servers:
            service.add_server(entry)
        yield service
    finally:
        service.shutdown()
        assert errors == []


class LocalServer(ThreadingHTTPServer):
    """A real HTTP server on 127.0.0.1 (a free port), serving from a daemon thread."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)

    def serve_in_background(self) -> None:
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass


class TextServer(LocalServer):
    """Serves `body` with `status` on every GET; optionally demands a bearer token or stalls."""

    def __init__(self, body: str = "", status: int = 200, token: str | None = None,
                 delay_s: float = 0.0) -> None:
        super().__init__(_TextHandler)
        self.body, self.status, self.token, self.delay_s = body, status, token, delay_s
        self.auth_headers: list[str | None] = []
        self.serve_in_background()


class _TextHandler(QuietHandler):
    server: TextServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        srv = self.server
        srv.auth_headers.append(self.headers.get("Authorization"))
        if srv.delay_s:
            time.sleep(srv.delay_s)
        if srv.token and self.headers.get("Authorization") != f"Bearer {srv.token}":
            self.send_response(401)
            self.end_headers()
            return
        data = srv.body.encode()
        self.send_response(srv.status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def serve_text():
    """Start TextServers (closed at the end of the test): serve_text(body, status=..., ...)."""
    started: list[TextServer] = []

    def start(body: str = "", **kw) -> TextServer:
        started.append(TextServer(body, **kw))
        return started[-1]

    yield start
    for server in started:
        server.close()


@pytest.fixture(scope="module")
def fuzz_servers():
    """A well-behaved vLLM-like server and one whose body a test changes at will."""
    good = TextServer("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n")
    bad = TextServer("")
    yield good, bad
    good.close()
    bad.close()


class PromApi(LocalServer):
    """Answers /api/v1/query from `answers` and /api/v1/query_range from `ranges` (expression
    -> JSON body text), as Prometheus does."""

    def __init__(self, answers: dict[str, str], ranges: dict[str, str] | None = None) -> None:
        super().__init__(_PromApiHandler)
        self.answers = answers
        self.ranges = ranges or {}
        self.seen: list[dict[str, list[str]]] = []
        self.serve_in_background()


class _PromApiHandler(QuietHandler):
    server: PromApi

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        parts = urlsplit(self.path)
        params = parse_qs(parts.query)
        self.server.seen.append(params)
        expr = params.get("query", [""])[0]
        answers = {"/api/v1/query": self.server.answers,
                   "/api/v1/query_range": self.server.ranges}.get(parts.path)
        if answers is None:
            status, body = 404, "404 page not found"
        elif expr in answers:
            status, body = 200, answers[expr]
        else:  # what Prometheus sends for an expression it cannot parse
            status, body = 400, json.dumps({"status": "error", "errorType": "bad_data",
                                            "error": f"parse error in {expr!r}"})
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def vector_answer(*rows: tuple[dict, str]) -> str:
    """A successful instant-query answer: one vector element per (labels, value text)."""
    result = [{"metric": metric, "value": [1700000000.5, value]} for metric, value in rows]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def matrix_answer(*rows: tuple[dict, list[tuple[float, str]]]) -> str:
    """A successful range-query answer: one matrix element per (labels, [(ts, value text)])."""
    result = [{"metric": metric, "values": [[ts, v] for ts, v in values]}
              for metric, values in rows]
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}})


@pytest.fixture
def prom():
    servers: list[PromApi] = []

    def start(answers: dict[str, str], ranges: dict[str, str] | None = None) -> PromApi:
        servers.append(PromApi(answers, ranges))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
