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
