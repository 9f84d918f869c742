"""A /metrics server on 127.0.0.1 with one hostile behaviour per path, beside a healthy one, and
a helper running `servescope record` the way a user does (the installed command, a subprocess)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

from tests.monitor.conftest import LocalServer, QuietHandler

HERE = Path(__file__).parent
HEALTHY = (HERE / "vllm_metrics_a.txt").read_bytes()
BIG_BYTES = 50 * 10**6
NAN_TEXT = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running NaN\n"
            b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting +Inf\n"
            b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc -Inf\n")
# Latin-1 "café" in a label value: one byte that can never start a UTF-8 sequence.
BAD_UTF8 = (b"# TYPE vllm:num_requests_running gauge\n"
            b'vllm:num_requests_running{model_name="caf\xe9"} 3\n')
RANDOM = random.Random(13).randbytes(4096)

# Path -> what a recorder must print as the reason it is down.
HOSTILE_REASONS = {
    "slow": "did not finish its answer within",
    "hang": "did not answer within",
    "big": "sent more than 16 MiB of metrics",
    "random": "sent bytes that are not UTF-8",
    "utf8": "sent bytes that are not UTF-8",
    "nan": "sent only NaN or ±Inf values",
    "missing": "answered HTTP 404",
}


class HostileServer(LocalServer):
    """/good/metrics answers like vLLM; /slow sends its body one byte every 0.5 s, /hang never
    answers, /big sends 50 MB without a length, /random random bytes, /utf8 a byte that is not
    UTF-8, /nan only NaN and ±Inf values, /missing a 404. `hits` counts requests per path."""

    # socketserver's backlog of 5 would drop the SYNs of a recorder connecting to all paths at
    # once, and the kernel's 1 s retry would read as a timeout of the path it happened to hit.
    request_queue_size = 64

    def __init__(self) -> None:
        super().__init__(_HostileHandler)
        self.closing = threading.Event()
        self.hits: dict[str, int] = {}
        self.serve_in_background()

    def url_for(self, name: str) -> str:
        return f"{self.url}/{name}/metrics"

    def close(self) -> None:
        self.closing.set()  # ends the slow and hanging answers, so shutdown does not wait
        super().close()


class _HostileHandler(QuietHandler):
    server: HostileServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        name = self.path.strip("/").split("/")[0]
        self.server.hits[name] = self.server.hits.get(name, 0) + 1
        # The recorder hanging up on a hostile answer is what it should do.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            getattr(self, f"_{name}", self._missing)()

    def _send(self, body: bytes, length: bool = True, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _good(self) -> None:
        self._send(HEALTHY)

    def _slow(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(HEALTHY)))
        self.end_headers()
        for i in range(len(HEALTHY)):
            if self.server.closing.wait(0.5):
                return
            self.wfile.write(HEALTHY[i:i + 1])
            self.wfile.flush()

    def _hang(self) -> None:
        self.server.closing.wait(60)

    def _big(self) -> None:
        # No Content-Length: the cap has to hold while the body streams in.
        self.send_response(200)
        self.end_headers()
        chunk = b"vllm:num_requests_running 1\n" * (2**20 // 28)
        for _ in range(BIG_BYTES // len(chunk) + 1):
            self.wfile.write(chunk)

    def _random(self) -> None:
        self._send(RANDOM)

    def _utf8(self) -> None:
        self._send(BAD_UTF8)

    def _nan(self) -> None:
        self._send(NAN_TEXT)

    def _missing(self) -> None:
        self._send(b"404 page not found\n", status=404)


def servescope_command() -> list[str]:
    """The installed `servescope` beside this interpreter, as a user runs it (falling back to
    the module when the package is not installed)."""
    script = Path(sys.executable).with_name("servescope")
    return [str(script)] if script.exists() else [sys.executable, "-m", "monitor.cli"]


def start_record(args: list[str], **kw) -> subprocess.Popen:
    """`servescope record ARGS` in a subprocess, stdout and stderr piped as text."""
    return subprocess.Popen([*servescope_command(), "record", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy(), **kw)
