"""The About box: what servescope is and the versions it runs with."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

from PySide6 import __version__ as pyside_version
from PySide6.QtCore import qVersion
from PySide6.QtWidgets import QMessageBox, QWidget


def _version(package: str) -> str:
    # Package metadata, not an import: the About box must not pull torch into a fresh process.
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Versions of servescope and the libraries that matter when reporting a problem."""
    torch_version = _version("torch")
    if "torch" not in sys.modules:
        torch_version += " (not loaded yet)"
    servescope = _version("servescope")
    return {
        "servescope": "0.1.0 (source checkout)" if servescope == "not installed" else servescope,
        "Python": platform.python_version(),
        "Qt": qVersion(),
        "PySide6": pyside_version,
        "PyTorch": torch_version,
        "gguf": _version("gguf"),
        "Platform": platform.platform(terse=True),
    }


def about_text(settings_path: str) -> str:
    """The About box's rich text."""
    rows = "".join(f"<tr><td><b>{name}</b></td><td>{value}</td></tr>"
                   for name, value in versions().items())
    return ("<h3>servescope</h3><p>Plan, run and watch LLM inference: a local PyTorch engine, "
            "a deployment planner and a live monitor in one window.</p>"
            f"<table cellspacing='4'>{rows}</table><p>Settings: {settings_path}</p>")


def show_about(parent: QWidget, settings_path: str) -> None:
    """Show the About box."""
    QMessageBox.about(parent, "About servescope", about_text(settings_path))
