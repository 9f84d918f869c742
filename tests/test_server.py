"""`servescope serve` for real on 127.0.0.1: the OpenAI API, streaming, batching and /metrics."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.server import serve

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def direct(llm) -> dict[str, str]:
    """Greedy texts from the engine itself, computed before the server's loop owns it."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def server(llm, direct):
    srv = serve(llm, "127.0.0.1", 0)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _complete(client, prompt: str, **extra) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                             "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(client, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


def test_models_and_health(client, llm):
    assert client.get("/health").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == llm.model_name and data[0]["max_model_len"] == llm.max_model_len


def test_completion_matches_the_engine(client, direct):
    out = _complete(client, PROMPTS[0])
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == direct[PROMPTS[0]]
    assert out["usage"]["completion_tokens"] == 12
    assert out["choices"][0]["finish_reason"] == "length"


def test_streaming_deltas_add_up(client):
    whole = _complete(client, PROMPTS[3])["choices"][0]["text"]
    body = {"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    pieces, usage = [], None
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            pieces += [c["text"] for c in event["choices"]]
            usage = event.get("usage", usage)
    assert "".join(pieces) == whole
    assert usage["completion_tokens"] == 12


def test_chat_whole_and_streamed(client):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 30}
    whole = client.post("/v1/chat/completions", json=body).json()
    text = whole["choices"][0]["message"]["content"]
    assert "Paris" in text and whole["object"] == "chat.completion"
    streamed = []
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += [c["delta"].get("content", "") for c in json.loads(line[6:])["choices"]]
    assert "".join(streamed) == text


def test_concurrent_requests_batch_and_metrics_count_them(client, direct):
    before = _metric(client, "vllm:time_to_first_token_seconds_count")
    tokens_before = _metric(client, "vllm:generation_tokens_total")
    alone = [_complete(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _complete(client, p), PROMPTS))
    texts = [o["choices"][0]["text"] for o in together]
    assert texts == [o["choices"][0]["text"] for o in alone] == [direct[p] for p in PROMPTS]
    assert _metric(client, "vllm:time_to_first_token_seconds_count") - before == 8
    sent = sum(o["usage"]["completion_tokens"] for o in alone + together)
    assert _metric(client, "vllm:generation_tokens_total") - tokens_before == sent
    assert _metric(client, "vllm:e2e_request_latency_seconds_count") >= 8
    assert _metric(client, "vllm:num_requests_running") == 0


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": "x" * 40000, "max_tokens": 4}, 400, "maximum context length"),
    ({"prompt": 5}, 400, "'prompt': Input should be a valid string"),
    ({"messages": "hi"}, 400, "'messages': Input should be a valid list"),
    ({"prompt": "hi", "temperature": -2}, 400, "temperature"),
])
def test_bad_requests_get_openai_errors(client, body, status, needle):
    url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(url, json=body)
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]
    assert _complete(client, PROMPTS[0])["choices"][0]["text"]  # still serving


def test_invalid_json_and_unknown_route(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "x"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert client.get("/v2/nothing").status_code == 404


def test_client_leaving_mid_stream_frees_its_blocks(client, llm):
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        for _ in zip(range(3), r.iter_lines(), strict=False):
            pass
    deadline = time.time() + 60
    while llm.has_unfinished() and time.time() < deadline:
        time.sleep(0.1)
    assert not llm.has_unfinished()
    assert llm.block_manager.num_used_blocks == 0


def test_api_key_is_required_when_set(llm):
    srv = serve(llm, "127.0.0.1", 0, api_key="s3cret")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v1/models").status_code == 401
            ok = c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        srv.close()


def test_spec_decode_counters_on_metrics(demo_gguf):
    spec_llm = LLM(str(demo_gguf), device="cpu", kv_cache_tokens=1024, speculative="ngram")
    srv = serve(spec_llm, "127.0.0.1", 0)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            text = "one two three four five six seven eight nine ten " * 3
            out = _complete(c, text, max_tokens=24)
            assert out["usage"]["completion_tokens"] == 24
            drafts = _metric(c, "vllm:spec_decode_num_draft_tokens_total")
            accepted = _metric(c, "vllm:spec_decode_num_accepted_tokens_total")
            assert drafts == spec_llm.spec.counters.draft_tokens > 0
            assert 0 < accepted <= drafts
            assert _metric(c, "vllm:spec_decode_num_drafts_total") == spec_llm.spec.counters.drafts
            # Drafts are verified against the model's own distribution: a request that would
            # change the logits is refused by name, not verified as if it did not.
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                "logit_bias": {"5": 3}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
            # Scoring a prompt by decoding forces every token: no drafts to verify, so refused.
            r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1,
                                                "prompt_logprobs": 0,
                                                "prompt_logprobs_decode_from": 4})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "prompt_logprobs_decode_from"
            assert "--speculative" in r.json()["error"]["message"]
    finally:
        srv.close()


LONG_PROMPT = "The history of the Roman Empire spans many centuries, beginning with"


def test_per_request_kv_policy_evicts_and_metrics_count_it(client, llm):
    evicted_before = _metric(client, "servescope:kv_evicted_tokens_total")
    engine_before = llm.evictor.tokens_evicted
    out = _complete(client, LONG_PROMPT, max_tokens=40, kv_policy="h2o", kv_budget=32)
    assert out["usage"]["completion_tokens"] == 40
    assert out["choices"][0]["text"].strip()
    evicted = _metric(client, "servescope:kv_evicted_tokens_total") - evicted_before
    # The prompt plus 40 tokens exceed the 32-token budget, so entries were dropped and counted.
    assert evicted == llm.evictor.tokens_evicted - engine_before > 0
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me about Rome."}], "max_tokens": 40,
        "temperature": 0, "kv_policy": "streaming", "kv_budget": "0.5"})
    assert chat.status_code == 200, chat.text
    assert _metric(client, "servescope:kv_evicted_tokens_total") - evicted_before > evicted
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("extra,needle", [
    ({"kv_policy": "lru", "kv_budget": 32}, "Unknown KV eviction policy 'lru'"),
    ({"kv_policy": "h2o"}, "needs kv_budget"),
    ({"kv_policy": "h2o", "kv_budget": "lots"}, "kv_budget must be a number"),
    ({"kv_policy": "h2o", "kv_budget": 1.5}, "fraction must be in (0, 1]"),
    ({"kv_policy": 3, "kv_budget": 32}, "'kv_policy': Input should be a valid string"),
])
def test_bad_kv_fields_get_a_400(client, extra, needle):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


def test_ttft_counts_from_the_request_reaching_the_server(client, llm, monkeypatch):
    """The engine's clock for a served request starts when the HTTP handler took it (before
    tokenizing and queueing), as vLLM's frontend arrival time does."""
    seen = []
    real = llm.add_request

    def spy(prompt, params=None, request_id=None, arrival=None, **options):
        seen.append((arrival, time.perf_counter()))
        return real(prompt, params, request_id=request_id, arrival=arrival, **options)

    monkeypatch.setattr(llm, "add_request", spy)
    _complete(client, PROMPTS[2])
    arrival, admitted = seen[-1]
    assert arrival is not None and arrival <= admitted


def test_a_stopped_server_frees_its_engine(demo_gguf):
    """The app starts and stops servers in one process: each stopped one must let its model
    go (FastAPI caches every endpoint function it has seen, process-wide)."""
    import gc
    import weakref

    llm = LLM(str(demo_gguf), device="cpu", kv_cache_tokens=256)
    server = serve(llm, port=0)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    server.close()
    engine = weakref.ref(llm)
    del llm, server
    gc.collect()
    assert engine() is None, [type(r).__name__ for r in gc.get_referrers(engine())]
