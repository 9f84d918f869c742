"""Screenshots of the window with the demo model answering, for the README (docs/screenshots/)."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtGui import QImage

# The committed screenshots are rewritten only on request (SERVESCOPE_SCREENSHOTS=1), so an
# ordinary test run leaves the checkout clean; otherwise they go to the test's temp folder.
DOCS_SHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"


def test_screenshots_of_the_engine_pane(loaded_window, qtbot, tmp_path: Path) -> None:
    shots = DOCS_SHOTS if os.environ.get("SERVESCOPE_SCREENSHOTS") == "1" else tmp_path
    window = loaded_window
    window.resize(1280, 840)
    pane = window.pane("engine")
    pane.chat.sampling.temperature.setValue(0.0)
    pane.chat.sampling.max_tokens.setValue(48)
    pane.chat.input.setPlainText("In two sentences, what does a KV cache do?")
    with qtbot.waitSignal(pane.chat.reply_done, timeout=120_000):
        pane.chat.send_button.click()
    window.notifications.clear()
    shots.mkdir(parents=True, exist_ok=True)
    for theme in ("dark", "light"):
        if (theme == "light") == (window.theme_action.isChecked()):
            window.toggle_theme()
        qtbot.wait(50)
        path = shots / f"engine-{theme}.png"
        assert window.grab().save(str(path))
        image = QImage(str(path))
        assert (image.width(), image.height()) == (1280, 840)
