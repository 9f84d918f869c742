"""The diagnosis against a real `servescope serve` (the engine on the demo model): short requests
alone give no verdict; one very long request among them is named as monopolising the batch."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from monitor.diagnosis import HubSeries, evaluate
from monitor.hub import Hub
from monitor.loadgen import LoadSpec, run_load
from monitor.remote import PrometheusSource, ServerConfig

LONG_PROMPT_WORDS, LONG_MAX_TOKENS = 600, 80


@pytest.fixture(scope="module")
def served(demo_gguf):
    from engine import LLM
    from engine.server import serve

    # A KV pool that holds the long request and the short ones: no preemption, so what slows
    # the short requests is the long one sharing their steps.
    srv = serve(LLM(str(demo_gguf), device="cpu", kv_cache_tokens=4096), "127.0.0.1", 0)
    yield srv
    srv.close()


def _short_load(url: str, requests: int):
    spec = LoadSpec(url=url, concurrency=2, requests=requests, input_len=8, output_len=8,
                    seed=1)
    result = run_load(spec)
    assert result.summary["failed"] == 0, result.summary["errors"][:2]
    return result


def _long_request(url: str, out: dict) -> None:
    words = ("the quick brown fox jumps over a lazy dog " * LONG_PROMPT_WORDS).split()
    began = time.monotonic()
    reply = httpx.post(url + "/v1/completions", timeout=300, json={
        "prompt": " ".join(words[:LONG_PROMPT_WORDS]), "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True, "temperature": 0.0})
    out["status"], out["seconds"] = reply.status_code, time.monotonic() - began
    out["usage"] = reply.json().get("usage", {})


def test_one_long_request_among_short_ones_is_named(served):
    source = PrometheusSource(ServerConfig("serve", served.url, interval_s=0.5))
    hub = Hub([source]).start()
    try:
        t0 = time.time()
        short_alone = _short_load(served.url, 6)
        t1 = time.time()
        alone = evaluate(HubSeries(hub), t0, t1)

        long_out: dict = {}
        long_thread = threading.Thread(target=_long_request, args=(served.url, long_out))
        shorts = threading.Thread(target=_short_load, args=(served.url, 16))
        shorts.start()
        time.sleep(1.0)  # the short requests are flowing when the long one arrives
        long_thread.start()
        long_thread.join(300)
        shorts.join(300)
        time.sleep(1.5)  # two more scrapes: the last requests' histograms are in
        t2 = time.time()
    finally:
        hub.stop()
    assert short_alone.summary["completed"] == 6
    assert long_out["status"] == 200 and long_out["usage"]["completion_tokens"] == LONG_MAX_TOKENS

    # Alone, the short requests are alike: no rule's conditions hold.
    assert alone.verdicts == [], alone.summary()

    mixed = evaluate(HubSeries(hub), t1, t2)
    named = [v for v in mixed.verdicts if v.rule == "long_request"]
    assert len(named) == 1, mixed.summary()
    verdict = named[0]
    assert verdict.title.startswith("a long request monopolising the batch")
    assert verdict.source == "serve"
    by_series = {e.series: e for e in verdict.evidence}
    e2e = by_series["serve/e2e_s_p99"]
    assert e2e.over == "serve/e2e_s_p50" and e2e.value >= 5.0
    # The long request's own time is the tail the histogram shows: its bucket holds it.
    assert e2e.summary["max"] >= 0.5 * long_out["seconds"]
    spikes = [e for e in verdict.evidence if e.threshold == "SPIKE_RATIO"]
    assert spikes and all(e.value >= 3.0 for e in spikes)
    print(f"\nlong request {long_out['seconds']:.1f} s; verdict: {verdict.title}; "
          + "; ".join(e.sentence() for e in verdict.evidence))
