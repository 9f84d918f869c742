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
    return {"ids": ids,
            "mean": sum(float(logp[i - 1, t]) for i, t in enumerate(ids) if i) / (len(ids) - 1)}


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
    for bad in ("http://x:1", "a=ftp://x", "a=http://x:1,every=soon", "a=http://x:1,color=red",
                "a=http://x:1,every=0", "b/c=http://x:1"):
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
