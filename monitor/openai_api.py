"""Servers without Prometheus metrics, found and watched through their OpenAI-compatible API.

TabbyAPI (ExLlamaV2), trtllm-serve without a Prometheus endpoint (its /metrics is JSON),
llama.cpp's server without --metrics, LM Studio and most OpenAI-compatible servers expose no
Prometheus text, but all answer GET /v1/models. The monitor then shows the server up with the
models it serves, and says that latencies and throughput come from load tests against it.
"""

from __future__ import annotations

import json
from typing import Any

from monitor.ollama import api_root

# The kind a model list's `owned_by` names, where a server fills it with its own name.
OWNERS = {"tabbyapi": "tabbyapi", "tensorrt_llm": "trtllm", "llamacpp": "llamacpp",
          "vllm": "vllm", "sglang": "sglang", "servescope": "servescope"}
GENERIC = "openai"
NOT_PROVIDED = ("no Prometheus /metrics: only the models it serves are seen; run a load test "
                "against its /v1 API for latencies and throughput")


class OpenAIApiError(Exception):
    """A /v1/models answer that is not an OpenAI model list; the message names the URL."""


def models_url(url: str) -> str:
    """Where a server lists its models (the API lives at the root, under /v1)."""
    return api_root(url) + "/v1/models"


def parse_models(text: str, url: str) -> list[dict[str, Any]]:
    """The model cards of a GET /v1/models body ({"object": "list", "data": [...]})."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise OpenAIApiError(f"{url} sent an answer that is not JSON ({exc})") from exc
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                             for m in data):
        raise OpenAIApiError(f"{url} sent JSON that is not an OpenAI model list (a \"data\" "
                             "list of models with ids)")
    return data


def kind_of(models: list[dict[str, Any]]) -> str:
    """The server kind the model cards name, else "openai" (any OpenAI-compatible server)."""
    for model in models:
        owner = str(model.get("owned_by") or "").strip().lower()
        if owner in OWNERS:
            return OWNERS[owner]
    return GENERIC


def model_values(models: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The series an API-only server gives: how many models it serves."""
    return [("models_served", float(len(models)))]
