"""A failure inside an engine step fails only the request it belongs to, and the server says so.

The fault is real engine code failing on one request's data: the detokenizer raising for one
request (as the tokenizer raised on a lone surrogate before requests were checked at the door).
The engine then recomputes each sequence of the failed batch alone; the others must produce
exactly the tokens they produce without the fault.
"""

from __future__ import annotations

import httpx
import pytest

import engine.output_processor as output_module
from engine import LLM, SamplingParams
from engine.server import serve
from monitor.remote import PrometheusSource, ServerConfig

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048, max_num_seqs=8)


@pytest.fixture()
def poisoned(monkeypatch):
    """The detokenizer fails for request 'bad' once it has produced three tokens."""
    real = output_module.append_token_text

    def append(tokenizer, seq):
        if seq.request_id.endswith("bad") and len(seq.output_token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(tokenizer, seq)

    monkeypatch.setattr(output_module, "append_token_text", append)


def _run(llm, ids: list[str]) -> dict:
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        llm.add_request(prompt, GREEDY, request_id=rid)
    outs = {}
    while llm.has_unfinished():
        for out in llm.step()[0]:
            if out.finished:
                outs[out.request_id] = out
    return outs


def test_a_failing_request_fails_alone(llm, poisoned):
    clean = _run(llm, ["a0", "a1", "a2"])
    outs = _run(llm, ["b0", "bad", "b2"])
    assert outs["bad"].finish_reason == "error"
    assert "UnicodeDecodeError" in outs["bad"].error
    for before, after in (("a0", "b0"), ("a2", "b2")):
        assert outs[after].finish_reason == "length"
        assert outs[after].token_ids == clean[before].token_ids
    assert llm.block_manager.num_used_blocks == 0
    assert not llm.has_unfinished()


def test_the_server_answers_the_failed_request_and_keeps_serving(llm, poisoned, monkeypatch):
    srv = serve(llm, "127.0.0.1", 0)
    ids = iter(["srv-bad"])
    monkeypatch.setattr(srv.loop, "_ids", ids)  # the first request gets the poisoned id
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            bad = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8,
                                                  "ignore_eos": True, "temperature": 0})
            assert bad.status_code == 500
            assert "other requests were not affected" in bad.json()["error"]["message"]
            monkeypatch.setattr(srv.loop, "_ids", iter(range(100)))
            ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert ok.status_code == 200
            assert c.get("/health").status_code == 200
            metrics = c.get("/metrics").text
            assert 'finished_reason="error"' in metrics
            # The recompute is counted (one request was in the failed step), and the monitor
            # reads it as servescope's series.
            isolated = [line for line in metrics.splitlines()
                        if line.startswith("servescope:engine_isolated_requests_total{")]
            assert len(isolated) == 1 and float(isolated[0].rsplit(" ", 1)[1]) == 1.0
            source = PrometheusSource(ServerConfig("iso", srv.url, interval_s=0.01))
            values = {s.series: s.value for s in source.poll(0.0).samples}
            source.close()
            assert values["iso/isolated_requests_total"] == 1.0
    finally:
        srv.close()


def test_an_engine_that_cannot_step_says_so(llm, monkeypatch):
    """The loop survives an error outside the engine's isolation; when the engine cannot step at
    all, /health says 503 with the reason and requests get 503, never a hang."""
    srv = serve(llm, "127.0.0.1", 0)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            monkeypatch.setattr(llm, "step_deltas", broken)
            monkeypatch.setattr(llm, "step", broken)
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503
            assert "device lost" in r.json()["error"]["message"]
            health = c.get("/health")
            assert health.status_code == 503
            assert "restart the server" in health.json()["error"]["message"]
            again = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert again.status_code == 503
    finally:
        monkeypatch.undo()
        srv.close()
        while llm.has_unfinished():  # leave the shared engine clean for the next test
            llm.step()
