"""Persistent user settings: one defaults table, read back through QSettings with explicit types."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QByteArray, QSettings

# Every persisted key lives here with its default; the default's type is the type it is read as,
# because the INI back end hands back strings ("true", "0.7") otherwise.
DEFAULTS: dict[str, Any] = {
    "ui/theme": "dark",
    "ui/pane": "engine",
    "window/geometry": QByteArray(),
    "window/state": QByteArray(),
    "engine/model": "",
    "engine/device": "auto",
    "engine/dtype": "auto",
    "engine/context_tokens": 2048,
    "engine/concurrency": 4,
    "engine/speculative": "off",
    "engine/prefix_caching": False,
    "engine/kv_policy": "none",
    "engine/kv_budget": "",
    "engine/weights": "float",
    "engine/kv_cache_dtype": "auto",
    "chat/system_prompt": "You are a helpful assistant.",
    "chat/temperature": 0.7,
    "chat/top_p": 0.95,
    "chat/top_k": 0,
    "chat/max_tokens": 256,
    "chat/seed": -1,
    "chat/splitter": QByteArray(),
    "monitor/window_s": 60.0,
    "monitor/slo_ttft_ms": 500.0,
    "monitor/slo_tpot_ms": 100.0,
}


class Settings:
    """Typed access to the app's QSettings store, restricted to the keys of DEFAULTS."""

    def __init__(self, store: QSettings | None = None) -> None:
        self._store = store if store is not None else QSettings()

    def get(self, key: str) -> Any:
        """Return the stored value of ``key``, or its default, as the default's type."""
        default = DEFAULTS[key]
        value = self._store.value(key, default, type=type(default))
        return default if value is None else value

    def set(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key``; unknown keys are a programming error."""
        if key not in DEFAULTS:
            raise KeyError(f"unknown setting {key!r}")
        self._store.setValue(key, value)

    def sync(self) -> None:
        """Write pending changes to disk now (Qt otherwise writes them lazily)."""
        self._store.sync()

    @property
    def path(self) -> str:
        """The file the settings live in, for the About box and bug reports."""
        return self._store.fileName()
