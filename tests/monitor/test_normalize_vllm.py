"""vLLM's prefix-cache, speculative-decoding and finished-reason counters, normalised."""

from __future__ import annotations

import pytest

from monitor.normalize import Normalizer
from monitor.promtext import parse_metrics

HEAD = '{engine="0",model_name="m"'


def _scrape(hits: float, queries: float, drafts: float, drafted: float, pos: tuple,
            length: float, stop: float) -> str:
    lines = [f"vllm:prefix_cache_hits_total{HEAD}}} {hits}",
             f"vllm:prefix_cache_queries_total{HEAD}}} {queries}",
             f"vllm:spec_decode_num_drafts_total{HEAD}}} {drafts}",
             f"vllm:spec_decode_num_draft_tokens_total{HEAD}}} {drafted}",
             f"vllm:spec_decode_num_accepted_tokens_total{HEAD}}} {sum(pos)}",
             f'vllm:request_success_total{HEAD},finished_reason="length"}} {length}',
             f'vllm:request_success_total{HEAD},finished_reason="stop"}} {stop}',
             f'vllm:request_success_total{HEAD},finished_reason="repetition"}} 0']
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{HEAD},position="{i}"}} {n}'
              for i, n in enumerate(pos)]
    return "\n".join(lines) + "\n"


def test_ratios_are_window_increases_by_vllms_definitions():
    n = Normalizer(window_s=10.0)
    n.update(parse_metrics(_scrape(0, 100, 10, 30, (5, 3, 1), 2, 1)), 0.0)
    second = dict(n.update(parse_metrics(_scrape(50, 300, 30, 90, (15, 9, 4), 6, 1)), 2.0))
    # Increases: hits 50 of 200 queries; 20 drafts of 60 tokens, 10 + 6 + 3 = 19 accepted.
    assert second["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert second["spec_acceptance_rate"] == pytest.approx(19 / 60)
    assert second["spec_mean_accepted_len"] == pytest.approx(1 + 19 / 20)
    assert [second[f"spec_acceptance_rate_at[position={i}]"] for i in range(3)] == \
        pytest.approx([10 / 20, 6 / 20, 3 / 20])
    assert second["requests_finished_reason_per_s[reason=length]"] == pytest.approx(2.0)
    assert second["requests_finished_reason_total[reason=stop]"] == 1.0
    assert second["requests_finished_reason_total[reason=repetition]"] == 0.0
    assert second["requests_finished_total"] == 7.0
    # Past the window the first increase is gone; with no new drafts there is no ratio.
    third = dict(n.update(parse_metrics(_scrape(50, 300, 30, 90, (15, 9, 4), 6, 1)), 20.0))
    assert "spec_acceptance_rate" not in third and "prefix_cache_hit_rate" not in third


def test_sglangs_acceptance_gauge_is_read_but_not_its_cache_hit_gauge():
    # SGLang's scheduler resets cache_hit_rate to 0 at every decode log: the hit rate comes from
    # its token counters instead (tests/monitor/test_normalize_peers.py).
    text = "sglang:cache_hit_rate 0.4\nsglang:spec_accept_length 2.5\n"
    values = dict(Normalizer().update(parse_metrics(text), 0.0))
    assert values == {"spec_mean_accepted_len": 2.5}


def test_every_histogram_quantile_comes_with_the_bucket_it_lies_in():
    from tests.monitor.test_remote import VLLM_A, VLLM_B

    n = Normalizer()
    n.update(parse_metrics(VLLM_A), 0.0)
    values = dict(n.update(parse_metrics(VLLM_B), 2.0))
    # 20 new TTFT observations: 10 in (0.1, 0.25], 10 in (0.25, 0.5].
    assert (values["ttft_s_p50_lo"], values["ttft_s_p50_hi"]) == (0.1, 0.25)
    assert (values["ttft_s_p99_lo"], values["ttft_s_p99_hi"]) == (0.25, 0.5)
    for q in ("p50", "p95", "p99"):
        assert values[f"ttft_s_{q}_lo"] <= values[f"ttft_s_{q}"] <= values[f"ttft_s_{q}_hi"]


def test_the_interval_is_unbounded_above_the_last_finite_bucket():
    import math

    from monitor.quantiles import histogram_quantile, quantile_interval

    buckets = [(0.1, 1.0), (1.0, 2.0), (math.inf, 10.0)]
    assert quantile_interval(0.99, buckets) == (1.0, math.inf)
    assert histogram_quantile(0.99, buckets) == 1.0  # Prometheus' floor
    assert quantile_interval(0.05, buckets) == (0.0, 0.1)
    assert all(math.isnan(x) for x in quantile_interval(0.5, [(math.inf, 0.0)]))
