"""The load generator in the planner's units, against a real `servescope serve` of the demo model
(the session's shared one): prompts of exactly N tokens of the server's tokenizer (from its
/tokenize), an arrival rate under a concurrency cap, and one sentence where a server cannot size
prompts in tokens."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from monitor.cli import main
from monitor.loadgen import LoadError, LoadSpec, request_lengths, run_load, token_pool
from tests.monitor.sshd import shared_engine_server


@pytest.fixture(scope="module")
def server(demo_gguf):
    return shared_engine_server(demo_gguf)


def test_tokenize_answers_as_vllms_does(server):
    text = "The quick brown fox"
    reply = httpx.post(server.url + "/tokenize", json={"prompt": text})
    assert reply.status_code == 200
    body = reply.json()
    assert body["tokens"] == server.llm.tokenizer.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == \
        server.llm.max_model_len
    wrong = httpx.post(server.url + "/tokenize", json={"prompt": text, "model": "gpt-4"})
    assert wrong.status_code == 404 and "gpt-4" in wrong.json()["error"]["message"]
    missing = httpx.post(server.url + "/tokenize", json={"text": text})
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]


def test_prompts_in_tokens_have_exactly_their_length_in_the_servers_tokens(server):
    spec = LoadSpec(url=server.url, concurrency=4, requests=12, input_len=40,
                    length_spread=0.5, output_len=6, input_unit="tokens", seed=3)
    result = run_load(spec)
    assert result.summary["failed"] == 0
    planned = request_lengths(spec, np.random.default_rng(3), 12)  # the run's own draw
    # The server's own usage counts: each request's tokens exactly as drawn (both spread).
    got = sorted((r.prompt_tokens, r.output_tokens) for r in result.records)
    assert got == sorted(planned)
    assert len({n for n, _ in got}) > 1
    # The words they are made of are the word prompts' (the same WORDS), in the server's ids.
    pool = set(token_pool(spec))
    assert len(pool) >= 10


def test_a_rate_with_a_concurrency_cap_never_exceeds_the_cap(server):
    """20 requests/s offered, at most 2 in flight: arrivals wait for a slot."""
    result = run_load(LoadSpec(url=server.url, rate=20.0, concurrency=2, requests=8,
                               input_len=16, output_len=8, input_unit="tokens", seed=5))
    assert result.summary["failed"] == 0
    spans = sorted((r.ts - r.e2e_s, r.ts) for r in result.records)
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2  # reached, never passed
    # Capped, 8 requests take at least 4 rounds of two, not the 0.4 s the rate alone would.
    assert result.duration_s >= 4 * min(r.e2e_s for r in result.records)


class _NoTokenize(BaseHTTPRequestHandler):
    """A server with no POST endpoints at all (http.server answers 501)."""

    def log_message(self, *args) -> None:
        pass


def test_a_server_without_tokenize_gets_one_sentence_saying_what_to_do(capsys):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoTokenize)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        with pytest.raises(LoadError, match="HTTP 501 without token ids"):
            run_load(LoadSpec(url=url, requests=1, input_unit="tokens"))
        code = main(["loadtest", "--url", url, "--input-unit", "tokens", "--requests", "1",
                     "--json", "--no-db"])
        error = json.loads(capsys.readouterr().out)["error"]
        assert code != 0 and error.endswith("give them in words instead")
        assert "\n" not in error and "Traceback" not in error
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_token_prompts_need_the_completions_endpoint():
    with pytest.raises(ValueError, match="only the completions endpoint"):
        LoadSpec("http://h", endpoint="chat", input_unit="tokens")
    with pytest.raises(ValueError, match="'words' or 'tokens'"):
        LoadSpec("http://h", input_unit="characters")
