"""The Monitor pane's plain-Python state: which series a chart draws, and the p99 bands."""

from __future__ import annotations

import numpy as np

from app.panes.monitor.state import CHARTS, aligned, band_keys, chart_series

SPECS = {spec.chart_id: spec for spec in CHARTS}
KEYS = ["vllm/ttft_s_p50", "vllm/ttft_s_p99", "vllm/ttft_s_p99_lo", "vllm/ttft_s_p99_hi",
        "vllm/ttft_s_p95", "vllm/ttft_s_p95_lo", "vllm/queue_s_p99", "vllm/prefill_s_p99",
        "vllm/decode_s_p50", "vllm/prefix_cache_hit_rate", "vllm/spec_acceptance_rate",
        "vllm/preemptions_per_s", "vllm/requests_finished_reason_per_s[reason=stop]",
        "sglang/ttft_s_p99", "sglang/ttft_s_p99_lo", "engine/ttft_s_p99"]


def test_the_vllm_series_have_their_charts() -> None:
    assert chart_series(SPECS["ttft"], KEYS) == [
        "engine/ttft_s_p99", "sglang/ttft_s_p99", "vllm/ttft_s_p50", "vllm/ttft_s_p95",
        "vllm/ttft_s_p99"]  # the _lo/_hi ends are bands, not lines
    assert chart_series(SPECS["phases"], KEYS) == ["vllm/prefill_s_p99", "vllm/queue_s_p99"]
    assert chart_series(SPECS["cache"], KEYS) == ["vllm/prefix_cache_hit_rate",
                                                  "vllm/spec_acceptance_rate"]
    assert chart_series(SPECS["events"], KEYS) == [
        "vllm/preemptions_per_s", "vllm/requests_finished_reason_per_s[reason=stop]"]


def test_every_series_vllm_sends_has_a_chart() -> None:
    """What the normaliser makes of vLLM's V1 metrics, each drawn somewhere: ITL beside TPOT
    (not only as its stand-in), end-to-end latency, every phase, acceptance per draft position,
    mean accepted length, and the token-count histograms."""
    keys = ["vllm/tpot_s_p99", "vllm/itl_s_p50", "vllm/itl_s_p99", "vllm/e2e_s_p95",
            "vllm/inference_s_p99", "vllm/decode_s_p99",
            "vllm/spec_acceptance_rate_at[position=0]", "vllm/spec_acceptance_rate_at[position=1]",
            "vllm/spec_mean_accepted_len", "vllm/iteration_tokens_p50",
            "vllm/request_prompt_tokens_p50", "vllm/request_generation_tokens_p50",
            "vllm/request_generation_tokens_p99"]
    drawn = {chart: chart_series(spec, keys) for chart, spec in SPECS.items()}
    assert drawn["tpot"] == ["vllm/tpot_s_p99"]  # TPOT itself where the server has it
    assert drawn["itl"] == ["vllm/itl_s_p50", "vllm/itl_s_p99"]
    assert drawn["e2e"] == ["vllm/e2e_s_p95"]
    assert drawn["phases"] == ["vllm/decode_s_p99", "vllm/inference_s_p99"]
    assert drawn["spec_pos"] == ["vllm/spec_acceptance_rate_at[position=0]",
                                 "vllm/spec_acceptance_rate_at[position=1]"]
    assert drawn["spec_len"] == ["vllm/spec_mean_accepted_len"]
    assert drawn["sizes"] == ["vllm/iteration_tokens_p50", "vllm/request_generation_tokens_p50",
                              "vllm/request_prompt_tokens_p50"]
    assert {k for keys_ in drawn.values() for k in keys_} >= set(keys) - {
        "vllm/request_generation_tokens_p99"}  # sizes are charted at their median


def test_a_band_needs_both_ends_of_the_bucket() -> None:
    drawn = chart_series(SPECS["ttft"], KEYS)
    # sglang's p99 lies in the last bucket (no upper end); the engine's is exact (no bucket).
    assert band_keys(drawn, KEYS) == {"vllm/ttft_s_p99": ("vllm/ttft_s_p99_lo",
                                                          "vllm/ttft_s_p99_hi")}
    ts, lo, hi = aligned((np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.1, 0.25])),
                         (np.array([2.0, 3.0]), np.array([0.25, 0.5])))
    assert ts.tolist() == [2.0, 3.0] and lo.tolist() == [0.1, 0.25] and hi.tolist() == [0.25, 0.5]
