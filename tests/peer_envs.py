"""The virtual environments of the peers the tests run for real (vLLM, SGLang), each with its
own pins: found by `SERVESCOPE_<NAME>_PYTHON` or the repo's `.venv-<name>`, else skipped with
the reason `.ci/run` exported or what to install."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def peer_python(name: str, what: str, install: str) -> str:
    """The Python of `.venv-<name>` (or SERVESCOPE_<NAME>_PYTHON), or pytest.skip saying why
    there is none: `what` names the peer, `install` says how to make the environment."""
    key = name.upper()
    why = os.environ.get(f"SERVESCOPE_{key}_UNAVAILABLE")
    if why:
        pytest.skip(f"{what} is unavailable: {why}")
    explicit = os.environ.get(f"SERVESCOPE_{key}_PYTHON")
    path = Path(explicit) if explicit else ROOT / f".venv-{name}" / "bin" / "python"
    if not path.exists():
        where = f"SERVESCOPE_{key}_PYTHON={explicit}" if explicit else f".venv-{name}/bin/python"
        pytest.skip(f"{what} is not installed ({where} does not exist): run .ci/run, or "
                    f"{install}")
    return str(path)
