"""Ollama servers: found through GET /api/version, read through GET /api/ps (no /metrics there)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

# Ollama exports no Prometheus metrics (ollama/ollama#3144), so only what /api/ps reports can
# be charted; latencies exist only in each response's own timing fields, seen by the caller.
NOT_PROVIDED = ("Ollama has no /metrics endpoint, so TTFT, TPOT, tokens/s, running / waiting "
                "requests and KV-cache usage are not available from it; run a load test "
                "against its OpenAI-compatible /v1 API for latencies")


class OllamaError(Exception):
    """An /api answer that is not Ollama's JSON; the message names the URL."""


def api_root(url: str) -> str:
    """scheme://host:port of a server URL (Ollama's API lives at the root)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def parse_version(text: str) -> str | None:
    """The version in a GET /api/version body ({"version": "0.5.7"}), or None if not Ollama's."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) and version else None


def parse_ps(text: str, url: str) -> list[dict[str, Any]]:
    """The loaded models of a GET /api/ps body ({"models": [{name, size, size_vram, ...}]})."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise OllamaError(f"{url} sent an answer that is not JSON ({exc})") from exc
    models = body.get("models") if isinstance(body, dict) else None
    if models is None:  # Ollama sends {"models": []} with nothing loaded, never a bare null
        raise OllamaError(f"{url} sent JSON without Ollama's \"models\" list")
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise OllamaError(f"{url} sent a \"models\" field that is not a list of objects")
    return models


def _bytes(model: dict[str, Any], key: str) -> float:
    value = model.get(key, 0)
    return float(value) if isinstance(value, int | float) and value >= 0 else 0.0


def ps_values(models: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The app's series from /api/ps: models loaded, their memory and the part in GPU memory,
    in total and per model (``model_vram_bytes[llama3:8b]``)."""
    out = [("models_loaded", float(len(models))),
           ("model_memory_bytes", sum(_bytes(m, "size") for m in models)),
           ("model_vram_bytes", sum(_bytes(m, "size_vram") for m in models))]
    for m in models:
        name = str(m.get("name") or m.get("model") or "?")
        out.append((f"model_vram_bytes[{name}]", _bytes(m, "size_vram")))
    return out
