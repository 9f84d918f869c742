"""Dark and light palettes on the Fusion style, so the app looks the same on every platform."""

from __future__ import annotations

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

THEMES = ("dark", "light")

_DARK = {
    QPalette.ColorRole.Window: "#1f2125",
    QPalette.ColorRole.WindowText: "#e6e6e6",
    QPalette.ColorRole.Base: "#16181b",
    QPalette.ColorRole.AlternateBase: "#24272c",
    QPalette.ColorRole.ToolTipBase: "#2b2e33",
    QPalette.ColorRole.ToolTipText: "#e6e6e6",
    QPalette.ColorRole.PlaceholderText: "#8a8f98",
    QPalette.ColorRole.Text: "#e6e6e6",
    QPalette.ColorRole.Button: "#2a2d32",
    QPalette.ColorRole.ButtonText: "#e6e6e6",
    QPalette.ColorRole.BrightText: "#ff6b6b",
    QPalette.ColorRole.Link: "#6cb6ff",
    QPalette.ColorRole.Highlight: "#3d7be0",
    QPalette.ColorRole.HighlightedText: "#ffffff",
}

_LIGHT = {
    QPalette.ColorRole.Window: "#f3f4f6",
    QPalette.ColorRole.WindowText: "#1d1f23",
    QPalette.ColorRole.Base: "#ffffff",
    QPalette.ColorRole.AlternateBase: "#eceef1",
    QPalette.ColorRole.ToolTipBase: "#ffffff",
    QPalette.ColorRole.ToolTipText: "#1d1f23",
    QPalette.ColorRole.PlaceholderText: "#7b808a",
    QPalette.ColorRole.Text: "#1d1f23",
    QPalette.ColorRole.Button: "#e7e9ed",
    QPalette.ColorRole.ButtonText: "#1d1f23",
    QPalette.ColorRole.BrightText: "#c62828",
    QPalette.ColorRole.Link: "#1f62c9",
    QPalette.ColorRole.Highlight: "#2f6fdb",
    QPalette.ColorRole.HighlightedText: "#ffffff",
}

# Banner colours per notification level: (background, border) for each theme.
LEVEL_COLOURS = {
    "dark": {"error": ("#4a1f22", "#e5534b"), "warning": ("#45381a", "#d9a520"),
             "info": ("#1d3149", "#4c8ee0")},
    "light": {"error": ("#fde7e7", "#d32f2f"), "warning": ("#fff4d6", "#c38a00"),
              "info": ("#e3effd", "#2f6fdb")},
}


def build_palette(theme: str) -> QPalette:
    """Return the QPalette of ``theme`` ("dark" or "light")."""
    roles = _DARK if theme == "dark" else _LIGHT
    palette = QPalette()
    for role, colour in roles.items():
        palette.setColor(role, QColor(colour))
    disabled = QColor("#6b7079") if theme == "dark" else QColor("#a0a4ab")
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText,
                 QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return palette


def apply_theme(app: QApplication, theme: str) -> None:
    """Switch the whole application to ``theme``."""
    app.setStyle("Fusion")
    app.setPalette(build_palette(theme))
    app.setProperty("servescope_theme", theme)


def current_theme() -> str:
    """The theme last applied, "dark" when none was."""
    app = QApplication.instance()
    theme = app.property("servescope_theme") if app is not None else None
    return theme if theme in THEMES else "dark"
