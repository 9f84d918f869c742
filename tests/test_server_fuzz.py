"""Fuzzing `servescope serve` from its own OpenAPI schema (schemathesis) over real HTTP.

Every generated request, valid or not, must get an answer that is not a server error (the 503
the schema documents is allowed), and the server must still answer a canary request after the
run. The engine has a short context so that generated requests stay quick.
"""

from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from engine import LLM
from engine.server import serve


@pytest.fixture(scope="module")
def fuzz_server(demo_gguf):
    llm = LLM(str(demo_gguf), device="cpu", kv_cache_tokens=1024, max_num_seqs=8,
              max_model_len=48)
    srv = serve(llm, "127.0.0.1", 0)
    yield srv
    srv.close()


def _operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_no_server_errors(fuzz_server):
    operations = _operations(fuzz_server.url)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    seen = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=40 if operation.method.upper() == "POST" else 5, deadline=None,
                  suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            response = case.call(timeout=120)
            seen.append(response.status_code)
            assert response.status_code < 500 or response.status_code == 503, (
                case.body, response.text)
            if response.status_code >= 400:
                assert "error" in response.json()

        fuzz()
    print("fuzz statuses", sorted(collections.Counter(seen).items()))
    assert len(seen) >= 40  # the generator really ran
    assert any(code == 200 for code in seen) and any(code == 400 for code in seen)


def test_still_serving_after_the_fuzzing(fuzz_server):
    r = httpx.post(f"{fuzz_server.url}/v1/completions",
                   json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
