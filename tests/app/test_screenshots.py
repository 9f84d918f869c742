"""The README's screenshots (docs/screenshots/), made on a real X server: Xvfb, Qt's xcb platform.

The suite runs Qt offscreen, and a process keeps its Qt platform, so this test starts Xvfb
(through pyvirtualdisplay) and runs tests/app/xvfb_screens.py in a child pytest on it. The
committed pictures are rewritten only on request (SERVESCOPE_SCREENSHOTS=1), so an ordinary run
leaves the checkout clean; otherwise they go to the test's temp folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

REPO = Path(__file__).resolve().parents[2]
DOCS_SHOTS = REPO / "docs" / "screenshots"
SCREEN = (1400, 900)
NAMES = ("engine-dark", "engine-light", "planner", "planner-ranking", "monitor")
XVFB_PACKAGES = "xvfb libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 " \
                "libxcb-cursor0 libxkbcommon-x11-0 (.ci/run installs them)"


@pytest.fixture(scope="module")
def x_display():
    """An Xvfb server of SCREEN's size; skips, saying why, where it cannot be started."""
    if shutil.which("Xvfb") is None:
        pytest.skip(f"Xvfb is not installed: apt-get install {XVFB_PACKAGES}")
    virtualdisplay = pytest.importorskip("pyvirtualdisplay", reason="pip install -e '.[dev]'")
    with virtualdisplay.Display(size=SCREEN, color_depth=24) as display:
        yield display.env()["DISPLAY"]


def test_readme_screenshots_from_a_real_x_server(x_display, tmp_path: Path) -> None:
    shots = DOCS_SHOTS if os.environ.get("SERVESCOPE_SCREENSHOTS") == "1" else tmp_path / "shots"
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "DISPLAY": x_display, "QT_QPA_PLATFORM": "xcb",
           "XDG_RUNTIME_DIR": str(runtime), "SERVESCOPE_SHOTS_DIR": str(shots)}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/app/xvfb_screens.py", "-q", "-x",
         "-p", "no:cacheprovider", "-n", "0", "--basetemp", str(tmp_path / "child")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if 'Could not load the Qt platform plugin "xcb"' in child.stdout + child.stderr:
        pytest.skip(f"Qt's xcb platform does not load: apt-get install {XVFB_PACKAGES}")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    for name in NAMES:
        image = QImage(str(shots / f"{name}.png"))
        assert (image.width(), image.height()) == SCREEN, name
        # A drawn window, not an empty framebuffer: many colours across the picture.
        grid = ((x, y) for x in range(0, SCREEN[0], 20) for y in range(0, SCREEN[1], 20))
        colours = {image.pixel(x, y) for x, y in grid}
        assert len(colours) > 20, f"{name}.png looks blank ({len(colours)} colours)"
