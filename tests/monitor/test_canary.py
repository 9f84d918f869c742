"""The quality canary from outside: the bundled held-out text scored over HTTP by a real
`servescope serve` of the demo model (the session's shared one), its perplexity equal to the
engine's own, its drift alert through a Recording, and one sentence for each failure."""

from __future__ import annotations

import json
import math
import random
import socket

import pytest
import torch

from monitor.canary import (
    CanaryBaseline,
    CanaryError,
    CanarySource,
    canary_rule,
    drift_ratio,
    heldout_text,
    parse_canary,
    score,
)
from monitor.recording import Recording
from tests.monitor.conftest import LocalServer, QuietHandler, monitor_session
from tests.monitor.sshd import shared_engine_server

# The first ~75 tokens of the held-out text: each score runs a prefill on 2 shared cores.
SAMPLE_CHARS = 340


@pytest.fixture(scope="module")
def server(demo_gguf):
    return shared_engine_server(demo_gguf)


@pytest.fixture(scope="module")
def sample() -> str:
    text = heldout_text()
    return text[:text.rindex(" ", 0, SAMPLE_CHARS)]


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith(".")
    assert message.count(". ") == 0, message  # one sentence, not a paragraph


def test_heldout_text_is_a_few_hundred_tokens_without_its_header(server):
    text = heldout_text()
    assert not text.startswith("#") and text.startswith("When in the Course of human events")
    assert 300 <= len(server.llm.tokenizer.encode(text)) <= 500


@pytest.fixture(scope="module")
def reference(server, sample) -> dict:
    """The sample's token ids and mean log-probability from LLM.prompt_logits' log-softmax."""
    assert server.loop.in_flight == 0  # the engine is idle: its own prefill is safe here
    ids = server.llm.tokenizer.encode(sample)
    logp = torch.log_softmax(server.llm.prompt_logits(ids), dim=-1)
    each = [float(logp[i - 1, t]) for i, t in enumerate(ids) if i]  # token i's, from i = 1
    return {"ids": ids, "each": each, "mean": sum(each) / len(each)}


@pytest.mark.parametrize("via", ["echo", "prompt_logprobs"])
def test_perplexity_equals_the_engines_own(server, sample, reference, via):
    """Each request shape (echo + logprobs; vLLM's prompt_logprobs without echo) gives the
    perplexity of the engine's own log-softmax over the same token ids."""
    got = score(server.url, server.llm.model_name, sample, methods=(via,))
    assert got.via == via and got.tokens == len(reference["ids"]) - 1
    assert got.mean_logprob == pytest.approx(reference["mean"], rel=1e-3)
    assert got.perplexity == pytest.approx(math.exp(-reference["mean"]), rel=1e-3)
    assert got.elapsed_s > 0


def test_drift_alert_fires_on_a_worse_score_and_not_on_the_baseline(server, sample):
    """A Recording's hub ticks the canary by hand: the first score is the baseline (drift 1,
    no alert); the same text with its words shuffled scores far worse and fires the rule.
    A per-request H2O 10% budget passes through `extra_body` and is accepted, but the server
    scores a prompt in one full-attention prefill of its own (engine/serve_loop.py), so the
    prompt's perplexity is the full cache's: prompt scoring cannot see KV eviction."""
    source = CanarySource("srv", server.url, text=sample, interval_s=300,
                          baseline=CanaryBaseline(scores=1))
    recording = Recording([source])
    recording.set_rules([canary_rule("srv", interval_s=300)])
    t0 = 1_000_000.0
    recording.hub.tick(t0)
    full = source.last
    assert source.status.state == "up" and full is not None
    assert recording.hub.latest("srv/canary_perplexity") == full.perplexity
    assert recording.hub.latest("srv/canary_tokens") == full.tokens
    assert recording.hub.latest("srv/canary_drift") == 1.0 and not recording.firing()

    h2o = score(server.url, None, sample, extra_body={"kv_policy": "h2o", "kv_budget": 0.1})
    assert drift_ratio(h2o.perplexity, full.perplexity) == pytest.approx(1.0, rel=1e-3)

    words = sample.split()
    random.Random(0).shuffle(words)
    source.text = " ".join(words)
    recording.hub.tick(t0 + 300)
    assert drift_ratio(source.last.perplexity, source.baseline.value) > 1.05
    assert source.baseline.value == full.perplexity  # the baseline stays the first score
    assert [e.rule for e in recording.firing()] == ["srv canary perplexity drift"]


DECODE_FROM = 8  # the sample's first 8 tokens prefilled, its other ~60 decoded one by one


@pytest.mark.parametrize("via", ["echo", "prompt_logprobs"])
def test_scoring_by_decoding_with_the_full_cache_equals_the_prefills_scores(server, sample,
                                                                            reference, via):
    """`prompt_logprobs_decode_from` (servescope's extension): tokens from that index on are
    decoded one at a time with the true token forced in; with the full cache each decoded
    log-probability is the prefill's, so the perplexity of the decoded tokens is the
    engine's own over the same tokens. The reply says it scored by decoding."""
    got = score(server.url, None, sample, methods=(via,), decode_from=DECODE_FROM)
    decoded = reference["each"][DECODE_FROM - 1:]
    assert got.tokens == len(decoded) == len(reference["ids"]) - DECODE_FROM
    assert got.mean_logprob == pytest.approx(sum(decoded) / len(decoded), rel=5e-3)


def test_the_canary_sees_kv_eviction_by_decoding_and_its_alert_fires(server, sample):
    """H2O at a 10% budget: invisible to a prefill's scores (drift 1.000, the test above), but
    scored by decoding, the evicting cache's perplexity is well above the full cache's, and
    the canary's drift alert fires against the full cache's score as the baseline."""
    full = score(server.url, None, sample, decode_from=DECODE_FROM)
    h2o_body = {"kv_policy": "h2o", "kv_budget": 0.1}
    prefilled = score(server.url, None, sample, extra_body=h2o_body)
    source = CanarySource("srv", server.url, text=sample, interval_s=300,
                          extra_body=h2o_body, decode_from=DECODE_FROM,
                          baseline=CanaryBaseline(pinned=full.perplexity))
    recording = Recording([source])
    recording.set_rules([canary_rule("srv", interval_s=300)])
    recording.hub.tick(1_000_000.0)
    drift = recording.hub.latest("srv/canary_drift")
    assert drift > 1.05 and drift == pytest.approx(source.last.perplexity / full.perplexity)
    assert [e.rule for e in recording.firing()] == ["srv canary perplexity drift"]
    # What the prefill-only canary reports for the same request: no loss at all.
    plain = score(server.url, None, sample)
    assert drift_ratio(prefilled.perplexity, plain.perplexity) == pytest.approx(1.0, rel=1e-3)


def test_scoring_by_decoding_is_refused_clearly_where_it_cannot_be_done(server, sample):
    """A request that asks to score by decoding without asking for prompt scores, or from
    outside the prompt, gets a 400 naming the field; a server that ignores the field (any
    server but servescope) makes the canary say so instead of storing prefill scores as
    decoded ones."""
    import httpx

    body = {"prompt": sample, "max_tokens": 1, "prompt_logprobs_decode_from": 4}
    for extra in ({}, {"prompt_logprobs": 0, "prompt_logprobs_decode_from": 10_000}):
        reply = httpx.post(server.url + "/v1/completions", json=body | extra, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "prompt_logprobs_decode_from"
        _one_sentence(reply.json()["error"]["message"])
    srv = LocalServer(_IgnoresDecoding)
    srv.serve_in_background()
    try:
        with pytest.raises(CanaryError) as caught:
            score(srv.url, None, "a short text", decode_from=2, timeout_s=5)
    finally:
        srv.close()
    _one_sentence(str(caught.value))
    assert "does not score prompts by decoding" in str(caught.value)


class _IgnoresDecoding(QuietHandler):
    """Echo with logprobs as OpenAI answers it, prompt_logprobs_decode_from ignored."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        reply = {"choices": [{"index": 0, "text": "a short text", "logprobs": {
            "token_logprobs": [None, -1.0, -2.0], "tokens": ["a", " short", " text"]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 0}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_baseline_median_and_pin():
    baseline = CanaryBaseline(scores=3)
    for value in (10.0, 30.0):
        baseline.add(value)
        assert baseline.value is None
    baseline.add(12.0)
    baseline.add(99.0)  # after the first three: not part of the baseline
    assert baseline.value == 12.0
    assert CanaryBaseline(pinned=15.0).value == 15.0
    with pytest.raises(ValueError):
        CanaryBaseline(pinned=float("nan"))
    assert canary_rule("a", tolerance=0.1).threshold == pytest.approx(1.1)


def test_unreachable_server_is_one_sentence(sample):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed on leaving: nothing listens there
    with pytest.raises(CanaryError) as caught:
        score(f"http://127.0.0.1:{port}", "m", sample, timeout_s=5)
    assert caught.value.reason in ("refused", "connect")
    assert f"127.0.0.1:{port}" in str(caught.value)
    _one_sentence(str(caught.value))
    source = CanarySource("gone", f"http://127.0.0.1:{port}", text=sample, timeout_s=5)
    assert source.poll(0.0).samples == [] and source.status.state == "down"
    assert source.status.last_error == str(caught.value)


class _NoPromptLogprobs(QuietHandler):
    """An OpenAI-compatible completions endpoint without prompt scoring: it refuses echo (as
    OpenAI's newer models do) and ignores prompt_logprobs (a plain completion comes back)."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if body.get("echo"):
            status, reply = 400, {"error": {"message": "echo is not supported", "param": "echo",
                                            "type": "invalid_request_error"}}
        else:
            status, reply = 200, {"choices": [{"index": 0, "text": " the", "logprobs": None}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_server_without_prompt_logprobs_is_one_sentence_naming_them():
    srv = LocalServer(_NoPromptLogprobs)
    srv.bodies = []
    srv.serve_in_background()
    try:
        with pytest.raises(CanaryError) as caught:
            score(srv.url, "m", "a short text of several tokens", timeout_s=5)
    finally:
        srv.close()
    message = str(caught.value)
    _one_sentence(message)
    assert "HTTP 400 naming 'echo'" in message
    assert "answered without them to 'prompt_logprobs'" in message
    assert [b.get("echo", False) for b in srv.bodies] == [True, False]
    assert srv.bodies[1]["prompt_logprobs"] == 0


def test_parse_canary_the_command_lines_form():
    source = parse_canary("srv=http://127.0.0.1:8000,every=60,model=m,baseline=12.5")
    assert (source.name, source.url, source.model, source.interval_s) == \
        ("srv", "http://127.0.0.1:8000", "m", 60.0)
    assert source.baseline.value == 12.5 and source.text == heldout_text()
    default = parse_canary("a=https://box:8000")
    assert default.interval_s == 300.0 and default.baseline.value is None
    assert default.decode_from is None
    assert parse_canary("a=http://x:1,decode=64").decode_from == 64
    for bad in ("http://x:1", "a=ftp://x", "a=http://x:1,every=soon", "a=http://x:1,color=red",
                "a=http://x:1,every=0", "b/c=http://x:1", "a=http://x:1,decode=0",
                "a=http://x:1,decode=half"):
        with pytest.raises(ValueError):
            parse_canary(bad)


def test_record_scores_a_canary_into_the_database(server, tmp_path, capsys):
    from monitor.cli import main
    from storage import queries
    from storage.db import open_database

    url = f"sqlite:///{tmp_path / 'canary.db'}"
    # The whole held-out text: a 465-token prefill a score, which takes seconds on 2 busy cores.
    code = main(["record", "--db", url, "--canary", f"srv={server.url},every=1",
                 "--duration", "6", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0 and out["sources"] == {"srv": "up"}, (out, captured.err)
    db = open_database(url)
    _, perplexity = queries.series_window(db, "srv/canary_perplexity", 0, 2e10, "raw")
    _, drift = queries.series_window(db, "srv/canary_drift", 0, 2e10, "raw")
    db.close()
    # The same text on the same server scores the same: drift stays at its baseline.
    assert len(perplexity) >= 1 and all(math.isfinite(p) and p > 1 for p in perplexity)
    assert perplexity.max() == pytest.approx(perplexity.min(), rel=1e-6)
    # Drift is stored once the baseline (the median of the first three scores) is known.
    assert len(drift) == max(0, len(perplexity) - 2)
    assert drift.tolist() == pytest.approx([1.0] * len(drift), rel=1e-6)
    bad = main(["record", "--db", url, "--canary", "srv=ftp://x", "--duration", "1", "--json"])
    assert bad == 2 and "not an http(s) URL" in json.loads(capsys.readouterr().out)["error"]


def test_a_saved_servers_canary_keeps_its_baseline_across_sessions(server, tmp_path):
    """The Monitor's service (no window): a server saved with a canary is scored on its
    schedule, and the next session on the same database judges drift from the first scores
    the earlier one stored, from its very first score (not after learning a new baseline)."""
    import time

    from app.panes.monitor.state import ServerEntry

    db_url = f"sqlite:///{tmp_path / 'monitor.db'}"
    key = "watched-canary/canary_"

    def session(until) -> tuple[list, list]:
        entry = ServerEntry("watched", server.url, canary_every_s=0.2)
        with monitor_session(db_url, entry) as service:
            deadline = time.monotonic() + 90
            while not until(service.hub) and time.monotonic() < deadline:
                time.sleep(0.1)
            return (list(service.hub.series(key + "perplexity")[1]),
                    list(service.hub.series(key + "drift")[1]))

    first_ppl, first_drift = session(lambda hub: len(hub.series(key + "drift")[1]) >= 1)
    assert len(first_ppl) >= 3  # the baseline: the median of the first three scores
    assert len(first_drift) == len(first_ppl) - 2
    again_ppl, again_drift = session(lambda hub: len(hub.series(key + "perplexity")[1]) >= 1)
    assert len(again_drift) == len(again_ppl) >= 1  # judged from the first score on
    assert again_drift[0] == pytest.approx(1.0, rel=1e-4)  # the same server, the same text
    assert again_ppl[0] == pytest.approx(first_ppl[0], rel=1e-4)
