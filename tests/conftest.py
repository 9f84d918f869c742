"""Shared fixtures: a reusable model cache and the real demo model."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


MAX_WORKERS = 4  # each worker loads its own models: more would cost memory, not time, here


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, at most MAX_WORKERS, at least two (on one core, waits
    still overlap)."""
    return max(2, min(MAX_WORKERS, os.cpu_count() or 1))


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker's torch (and every server a test starts) gets its share
    of the cores: two workers each running two threads on two cores would fight."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config: pytest.Config) -> None:
    _share_the_cores_between_workers()
    # The demo model is downloaded once into the repo's .cache and reused across runs;
    # the registry goes to a throwaway folder so tests never touch the user's own.
    os.environ.setdefault("SERVESCOPE_CACHE_DIR", str(REPO / ".cache" / "models"))
    os.environ.setdefault("SERVESCOPE_CONFIG_DIR", tempfile.mkdtemp(prefix="servescope-config-"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The real vLLM server is one per worker (a session fixture): its tests share one worker,
    # so it starts once.
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("vllm"))


@pytest.fixture(autouse=True, scope="module")
def release_memory_after_each_module(request):
    """Engines and servers a module made are freed when it ends: collect their reference
    cycles and give glibc's freed pages back, so a worker's memory does not grow module after
    module (two workers and a vLLM server share this machine's memory)."""
    yield
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    log = os.environ.get("SERVESCOPE_TEST_RSS_LOG")
    if log:  # where memory goes, module by module (a diagnostic for this fixture's purpose)
        with open(f"/proc/{os.getpid()}/status") as f:
            rss = next(line.split()[1] for line in f if line.startswith("VmRSS"))
        with open(log, "a") as out:
            llms = sum(type(o).__name__ == "LLM" for o in gc.get_objects())
            out.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {int(rss) >> 10} MB "
                      f"{llms} LLMs {request.node.nodeid}\n")


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The demo GGUF (SmolLM2-135M-Instruct Q4_1), fetched on first use."""
    from engine.models import fetch_demo_model

    return fetch_demo_model(progress=lambda message, fraction: None)


@pytest.fixture(scope="session")
def demo_checkpoint(demo_gguf: Path):
    """The demo model loaded in float32."""
    from engine.loader import load_checkpoint

    return load_checkpoint(demo_gguf)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python of the virtual environment holding real vLLM (skips, saying why, without)."""
    from tests.vllm.server import vllm_python

    return vllm_python()


# SGLang's own argument checks (tests/planner/sglang_accepts.py) run in an environment of its
# own: it pins another torch and transformers. `.ci/run` makes it; by hand, see the README.
SGLANG_VERSION = "0.5.23"


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The Python of the virtual environment holding SGLang (skips, saying why, without)."""
    from tests.peer_envs import peer_python

    return peer_python("sglang", "SGLang", f"make .venv-sglang as .ci/run's install_sglang "
                                           f"does (sglang=={SGLANG_VERSION})")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One real vLLM server on 127.0.0.1 serving the demo model as "demo", for the session."""
    from tests.vllm.server import session_server

    yield from session_server(tmp_path_factory.mktemp("vllm"))
