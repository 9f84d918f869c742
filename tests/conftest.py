"""Shared fixtures: a reusable model cache and the real demo model."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # The demo model is downloaded once into the repo's .cache and reused across runs;
    # the registry goes to a throwaway folder so tests never touch the user's own.
    os.environ.setdefault("SERVESCOPE_CACHE_DIR", str(REPO / ".cache" / "models"))
    os.environ.setdefault("SERVESCOPE_CONFIG_DIR", tempfile.mkdtemp(prefix="servescope-config-"))


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


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One real vLLM server on 127.0.0.1 serving the demo model as "demo", for the session."""
    from tests.vllm.server import session_server

    yield from session_server(tmp_path_factory.mktemp("vllm"))
