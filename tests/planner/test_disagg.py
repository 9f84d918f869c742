"""Disaggregated prefill/decode plans: the KV transfer from first principles, the decode pool's
steps free of prefill, the ranking against aggregated plans under the same SLOs both ways, and
the commands each pool runs."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from planner.catalog import load_catalog
from planner.disagg import NIC_GBS, DisaggDeployment, compare, simulate_disagg
from planner.evaluate import evaluate
from planner.export import disagg_vllm_commands
from planner.search import SearchSpace
from planner.simulate import Replica, run_replica
from planner.timing import Deployment, Efficiency
from planner.workload import Slo, Workload

SPACE = SearchSpace(gpus=("H100 SXM",), weights=("bf16",), kv=("bf16",), tp=(1, 2, 4, 8),
                    pp=(1,), spec=(None,), max_seqs=(64, 256))
# 16K-token prompts, 512-token replies, TPOT p99 <= 30 ms on Llama-3.1-70B: the case
# disaggregation is for (long prompts, tight TPOT).
LONG = Workload(16384, 512, rate=1, slo=Slo(ttft_p99_ms=8000, tpot_p99_ms=30), num_requests=300)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


@pytest.fixture(scope="module")
def long_prompts(catalog):
    return compare(catalog.model("Llama-3.1-70B"), LONG, catalog, SPACE)


def test_kv_transfer_is_the_prompts_cache_over_the_narrower_sides_nics(catalog):
    """Llama-3.1-8B bf16 KV: 2 (K,V) x 32 layers x 8 heads x 128 dims x 2 bytes = 128 KiB a
    token; a TP2 prefill sends to a TP4 decode over 2 NICs at once."""
    m, h100 = catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM")
    dd = DisaggDeployment(Deployment(m, h100, tp=2), Deployment(m, h100, tp=4), 1, 1)
    expected = 10e-6 + 8192 * 2 * 32 * 8 * 128 * 2 / (2 * NIC_GBS * 1e9 * 0.7)
    assert dd.transfer_seconds(8192, 0.7) == pytest.approx(expected, rel=1e-12)


def test_a_request_arriving_with_its_prompt_cached_computes_one_token_then_decodes():
    """What the decode pool does: prompt minus one token precomputed, so the first token comes
    after one step, not after a prefill."""
    replica = Replica(lambda *a: 0.01, max_seqs=8, max_batched_tokens=512, kv_tokens=100000)
    arrivals, inputs, outputs = np.array([0.0]), np.array([4000]), np.array([5])
    cold, _ = run_replica(replica, arrivals, inputs, outputs)
    warm, _ = run_replica(replica, arrivals, inputs, outputs, precomputed=inputs - 1)
    assert warm.first[0] == pytest.approx(0.01)
    assert cold.first[0] == pytest.approx(0.01 * 8)  # 4000 tokens in 512-token chunks
    assert warm.finish[0] - warm.first[0] == pytest.approx(4 * 0.01)


def test_ttft_splits_into_prefill_transfer_and_first_decode_step(catalog):
    m, h100 = catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM")
    dd = DisaggDeployment(Deployment(m, h100, tp=2, max_batched_tokens=8192),
                          Deployment(m, h100, tp=1, max_seqs=64), 1, 1)
    res = simulate_disagg(dd, Workload(8192, 256, rate=4, num_requests=300))
    assert res.sim.ttft.mean() == pytest.approx(res.prefill_s + res.transfer_s
                                                + res.decode_first_s, rel=1e-9)
    # An idle link would take exactly one transfer: queueing behind others only adds to it.
    assert res.transfer_s >= dd.transfer_seconds(8192, Efficiency().link) - 1e-12


def test_decode_pool_tpot_beats_the_same_layout_serving_both_phases(catalog):
    """Same GPU, same TP1 decode layout, same traffic: without prefill chunks in its steps the
    decode replica's TPOT p99 is lower than the aggregated replica's."""
    m, h100 = catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM")
    w = Workload(8192, 256, rate=2, num_requests=300)
    decode = Deployment(m, h100, tp=1, max_seqs=64)
    aggregated = evaluate(decode, w).result.summary("tpot")["p99"]
    split = simulate_disagg(DisaggDeployment(
        Deployment(m, h100, tp=1, max_batched_tokens=8192), decode, 1, 1), w)
    assert split.sim.summary("tpot")["p99"] < 0.5 * aggregated


def test_long_prompts_and_tight_tpot_rank_disaggregated_first_with_the_reason(long_prompts):
    c = long_prompts
    assert c.winner == "disaggregated" and c.ratio > 1.0
    b, a = c.disaggregated, c.aggregated
    assert b.ttft_p99_ms <= LONG.slo.ttft_p99_ms and b.tpot_p99_ms <= LONG.slo.tpot_p99_ms
    assert a.ttft_p99_ms <= LONG.slo.ttft_p99_ms and a.tpot_p99_ms <= LONG.slo.tpot_p99_ms
    assert b.cost_per_hour * c.ratio == pytest.approx(a.cost_per_hour)
    assert b.deployment.gpus < a.deployment.gpus * a.replicas
    assert "prefill chunk" in c.reason and "KV transfer" in c.reason
    # Each pool's GPU-hours are billed to its own tokens.
    assert b.cost_per_1m_input > 0 and b.cost_per_1m_output > 0
    json.dumps(c.as_dict())


def test_short_prompts_and_loose_tpot_keep_aggregated_first(catalog):
    w = Workload(512, 256, rate=4, slo=Slo(ttft_p99_ms=1000, tpot_p99_ms=50), num_requests=300)
    c = compare(catalog.model("Llama-3.1-8B"), w, catalog, SPACE)
    assert c.winner == "aggregated"
    assert c.disaggregated is None or c.disaggregated.cost_per_hour >= c.aggregated.cost_per_hour


def test_pools_must_share_the_kv_precision(catalog):
    m, h100 = catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM")
    with pytest.raises(ValueError, match="same weight and KV precision"):
        DisaggDeployment(Deployment(m, h100, kv="fp8"), Deployment(m, h100), 1, 1)


def test_each_pool_gets_its_own_vllm_command_with_the_nixl_connector(long_prompts):
    dd = long_prompts.disaggregated.deployment
    commands = disagg_vllm_commands(long_prompts.disaggregated)
    for role, d in (("prefill", dd.prefill), ("decode", dd.decode)):
        argv = shlex.split(commands[role])
        assert argv[argv.index("--tensor-parallel-size") + 1] == str(d.tp)
        assert argv[argv.index("--max-num-batched-tokens") + 1] == str(d.max_batched_tokens)
        assert argv[argv.index("--max-model-len") + 1] == str(16384 + 512)
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def test_plan_search_disaggregated_prints_the_comparison_and_both_pools_commands(capsys):
    import argparse

    from planner.cli import add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    line = ("plan search --model Llama-3.1-70B --input-len 16384 --output-len 512 --rate 1 "
            "--ttft-p99-ms 8000 --tpot-p99-ms 30 --gpus H100 --num-requests 200 --top 1 "
            "--disaggregated --json")
    args = parser.parse_args(shlex.split(line))
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["comparison"]
    assert c["winner"] in ("aggregated", "disaggregated") and c["reason"]
    assert set(c["disaggregated"]["vllm_commands"]) == {"prefill", "decode"}
    assert c["aggregated"]["cost_per_hour"] == out["candidates"][0]["cost_per_hour"]
    assert out["basis"]["ttft_p99_ms"]["error_band"]["points"] >= 1
    assert c["disaggregated"]["basis"]["kv_transfer"]["error_band"] is None
