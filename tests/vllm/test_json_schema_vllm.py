"""`response_format` `json_schema` read as real vLLM reads it: an object that lists its
properties allows no others unless its schema says so (vLLM's xgrammar in strict mode;
servescope's engine/grammar.py closed_objects), on the same demo model and request."""

from __future__ import annotations

import json

import openai
import pytest

from engine import LLM
from engine.server import serve

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
          "required": ["name"]}
ASK = [{"role": "user", "content": "Give a JSON object with a name."}]


@pytest.fixture(scope="module")
def servescope(demo_gguf):
    """(url, model name) of a `servescope serve` of the demo model."""
    llm = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=2048)
    srv = serve(llm, "127.0.0.1", 0)
    yield srv.url, llm.model_name
    srv.close()


def _reply(url: str, model: str) -> tuple[str, dict]:
    """The finish reason and the parsed reply of a greedy json_schema request."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    return out.choices[0].finish_reason, json.loads(out.choices[0].message.content)


def test_an_object_schema_is_closed_on_vllm_and_on_servescope(vllm_server, servescope):
    finish, reply = _reply(vllm_server.url, vllm_server.model)
    assert finish == "stop" and list(reply) == ["name"], reply
    finish, reply = _reply(*servescope)
    assert finish == "stop" and list(reply) == ["name"], reply
