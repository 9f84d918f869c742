"""The diagnosis on the session's real vLLM (a 1 GiB KV cache, ~46,000 tokens): the KV-pressure
and long-request rules read its live series and, under a load that fits, name nothing. The
KV-pressure verdict itself is tested on a recording of vLLM with a 1,536-token cache
(tests/monitor/test_diagnosis_rules.py, recorded by benchmarks/diagnosis_vllm_kv.py)."""

from __future__ import annotations

import time

from monitor.diagnosis import THRESHOLDS, HubSeries, evaluate
from monitor.hub import Hub
from monitor.loadgen import LoadSpec, run_load
from monitor.remote import PrometheusSource, ServerConfig
from tests.vllm.test_monitor_vllm import _wait_idle


def test_a_load_that_fits_is_judged_and_not_blamed_on_the_kv_cache(vllm_server):
    _wait_idle(vllm_server.url)
    hub = Hub([PrometheusSource(ServerConfig("vllm-live", vllm_server.url, interval_s=0.5))])
    hub.start()
    try:
        t0 = time.time()
        time.sleep(1.0)  # a first scrape before the load: its histograms count from there
        result = run_load(LoadSpec(url=vllm_server.url, model=vllm_server.model, concurrency=3,
                                   requests=6, input_len=24, output_len=16, seed=5))
        _wait_idle(vllm_server.url)
        time.sleep(1.2)
        t1 = time.time()
    finally:
        hub.stop()
    assert result.summary["completed"] == 6
    diagnosis = evaluate(HubSeries(hub), t0, t1)
    # vLLM's own series feed both rules (a renamed metric would leave them unjudged) ...
    assert "kv_pressure" not in diagnosis.not_evaluated
    assert "long_request" not in diagnosis.not_evaluated
    # ... and the figures they judge say why neither holds.
    _, kv = hub.series("vllm-live/kv_cache_usage")
    _, preempted = hub.series("vllm-live/preemptions_total")
    assert kv.max() < THRESHOLDS["KV_FULL"].value and preempted[-1] == preempted[0]
    rules = {v.rule for v in diagnosis.verdicts}
    assert not rules & {"kv_pressure", "long_request"}, diagnosis.summary()
    # No GPU here: the GPU rules say they lacked their series rather than passing silently.
    assert {"memory_bound", "gpu_throttling", "ecc_corrections"} <= set(diagnosis.not_evaluated)
