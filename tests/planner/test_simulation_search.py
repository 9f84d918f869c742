"""The simulator against queueing theory, the search against its constraints, the command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from planner.catalog import load_catalog
from planner.cli import add_plan_parser
from planner.export import kubernetes_yaml, ranking_csv, sglang_command, vllm_command
from planner.search import Cancelled, SearchSpace, search, shape
from planner.simulate import Replica, simulate
from planner.workload import Slo, Workload


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_md1_mean_wait_within_5_percent(rho):
    """One-token requests on a one-sequence replica with a constant step are an M/D/1 queue:
    mean wait = rho * D / (2 (1 - rho))."""
    service = 0.01
    replica = Replica(lambda *a: service, max_seqs=1, max_batched_tokens=8, kv_tokens=64)
    waits = []
    for seed in range(8):
        w = Workload(1, 1, rate=rho / service, num_requests=20000, seed=seed)
        waits.append(float(np.mean(simulate(replica, w).ttft - service)))
    theory = rho * service / (2 * (1 - rho))
    assert np.mean(waits) == pytest.approx(theory, rel=0.05)


def test_a_finite_runs_throughput_spans_first_arrival_to_last_finish():
    """Three 4-token requests arriving within a millisecond on a one-sequence replica with a
    0.1 s step: each takes four steps in turn, so the run ends 1.2 s after the first arrives and
    a load generator measures 12 tokens / 1.2 s. The steady-state figure divides by the finish
    span only (0.8 s), which leaves the first request's service out."""
    replica = Replica(lambda *a: 0.1, max_seqs=1, max_batched_tokens=8, kv_tokens=64)
    result = simulate(replica, Workload(2, 4, rate=1e4, num_requests=3))
    assert result.run_throughput_tok_s == pytest.approx(12 / 1.2, rel=0.01)
    assert result.throughput_tok_s == pytest.approx(12 / 0.8, rel=0.01)


def test_closed_loop_decode_matches_step_time():
    """C sequences decoding together at a constant 10 ms step: TPOT is the step."""
    replica = Replica(lambda *a: 0.01, max_seqs=8, max_batched_tokens=4096, kv_tokens=100000)
    res = simulate(replica, Workload(16, 100, concurrency=8, num_requests=64))
    assert res.summary("tpot")["p50"] == pytest.approx(10.0, rel=0.02)
    assert res.throughput_tok_s == pytest.approx(800.0, rel=0.05)


def test_a_closed_loops_client_timing_splits_each_wave_as_real_vllm_did():
    """Four fixed-length requests in a closed loop, a step costing 1 ms a prompt token: with an
    ideal client every wave arrives at once and is prefilled together (TTFT p99 = p50); sent as
    the load generator sends them, the first of each wave reaches the idle engine alone, and
    the other three wait for its prefill (real vLLM here: TTFT 119-144 ms for one request of
    each round against 303-398 ms for the other three). A lockstep prediction had no tail."""
    from app.plan_run import run_workload

    replica = Replica(lambda prefill, *a: 0.01 + 0.001 * prefill, max_seqs=8,
                      max_batched_tokens=4096, kv_tokens=100000)
    w = Workload(100, 8, concurrency=4)
    ideal = np.sort(simulate(replica, replace(w, num_requests=16)).ttft)
    assert ideal[-1] == pytest.approx(ideal[len(ideal) // 2], rel=0.01)
    ttft = np.sort(simulate(replica, run_workload(w, 16)).ttft)
    alone, waited = ttft[:4], ttft[4:]
    assert alone.max() < 0.5 * waited.min()  # one ahead of three, every wave
    assert waited.min() > 0.11 + 0.31 - 0.01  # its prefill, then the three prompts' together


def test_kv_pressure_preempts_and_still_finishes():
    replica = Replica(lambda *a: 0.01, max_seqs=64, max_batched_tokens=4096, kv_tokens=3000)
    res = simulate(replica, Workload(100, 400, concurrency=16, num_requests=48))
    assert res.preemptions > 0 and res.e2e.size == 48 and np.all(np.isfinite(res.e2e))


def test_search_results_respect_every_constraint(catalog):
    slo = Slo(ttft_p99_ms=1500, tpot_p99_ms=40)
    w = Workload(800, 200, rate=8, slo=slo, num_requests=300)
    space = SearchSpace(gpus=("H100 SXM", "A100 80GB", "L40S"), max_seqs=(32, 128))
    result = search(catalog.model("Llama-3.1-70B"), w, catalog, space, budget_per_hour=40.0)
    assert result.candidates and result.evaluated == 3 * 4 * 2 * 4 * 3 * 2 * 2
    costs = [p.cost_per_hour for p in result.candidates]
    assert costs == sorted(costs)
    for p in result.candidates:
        assert p.simulated and p.memory.fits and p.cost_per_hour <= 40.0
        assert p.ttft_p99_ms <= 1500 and p.tpot_p99_ms <= 40
        assert p.deployment.gpu.name in space.gpus
    front = result.pareto
    assert all(a.e2e_p99_ms > b.e2e_p99_ms for a, b in zip(front, front[1:], strict=False))


def test_ranking_folds_batch_limits_and_the_front_spans_the_trade_off(catalog):
    """Two batch limits per shape: the ranking shows each shape once, saying how many variants
    it absorbed; the simulated set includes the screened Pareto set, so the front has several
    cost/latency points rather than the cheapest plan alone."""
    w = Workload(1000, 200, rate=20, slo=Slo(2000, 50), num_requests=300)
    space = SearchSpace(gpus=("H100 SXM", "MI300X"), weights=("fp8",), kv=("fp8",),
                        max_seqs=(16, 64))
    result = search(catalog.model("Llama-3.1-70B"), w, catalog, space)
    shapes = [shape(p.deployment) for p in result.candidates]
    assert len(shapes) == len(set(shapes))
    assert sum(p.folded for p in result.candidates) == result.folded
    assert result.folded >= 1
    assert f"{result.folded} plan(s) differing only in the batch limit" in result.notes[0]
    assert result.simulated > 12  # the screened front and 16 cheapest shapes, not 12 plans
    front = result.pareto
    assert len(front) >= 3 and all(p.simulated for p in front)
    assert all(a.cost_per_hour < b.cost_per_hour and a.e2e_p99_ms > b.e2e_p99_ms
               for a, b in zip(front, front[1:], strict=False))
    assert front[0].cost_per_hour == result.candidates[0].cost_per_hour
    assert result.candidates[0].as_dict()["folded_variants"] == result.candidates[0].folded


def test_infeasible_memory_names_sizes_and_relaxation(catalog):
    w = Workload(500, 100, rate=1, slo=Slo(5000, 100))
    space = SearchSpace(gpus=("L4",), weights=("bf16",), tp=(1, 2), pp=(1,))
    result = search(catalog.model("Llama-3.1-405B"), w, catalog, space)
    assert not result.candidates
    assert "weights need 812 GB at bf16; the largest option holds 48 GB" in result.infeasible
    assert "nearest feasible relaxation: int4 weights" in result.infeasible


def test_infeasible_slo_and_budget_say_what_to_relax(catalog):
    space = SearchSpace(gpus=("H100 SXM",), max_seqs=(64,), spec=(None,))
    tight = search(catalog.model("Llama-3.1-8B"), Workload(500, 100, rate=2, slo=Slo(5000, 1)),
                   catalog, space)
    assert "lowest TPOT" in tight.infeasible and "SLO 1 ms" in tight.infeasible
    poor = search(catalog.model("Llama-3.1-8B"), Workload(500, 100, rate=2, slo=Slo(5000, 50)),
                  catalog, space, budget_per_hour=0.5)
    assert "raise the budget" in poor.infeasible


def test_search_reports_progress_and_cancels(catalog):
    seen = []
    w = Workload(500, 100, rate=2, slo=Slo(5000, 50))
    search(catalog.model("Llama-3.1-8B"), w, catalog, SearchSpace(gpus=("L4",)),
           progress=lambda f, msg: seen.append(f))
    assert seen and all(0 <= f <= 1 for f in seen)
    with pytest.raises(Cancelled):
        search(catalog.model("Llama-3.1-8B"), w, catalog, cancel=lambda: True)


def test_exports_carry_the_plan(catalog):
    w = Workload(500, 100, rate=4, slo=Slo(3000, 60), num_requests=200)
    space = SearchSpace(gpus=("H100 SXM",), weights=("fp8",), kv=("fp8",), tp=(2,), pp=(1,),
                        max_seqs=(64,), spec=(None,))
    plan = search(catalog.model("Llama-3.1-70B"), w, catalog, space).candidates[0]
    cmd = vllm_command(plan)
    assert "--tensor-parallel-size 2" in cmd and "--kv-cache-dtype fp8" in cmd
    assert "--quantization fp8" in cmd and "--max-num-seqs 64" in cmd
    assert "--tp-size 2" in sglang_command(plan)
    yaml = kubernetes_yaml(plan)
    assert "kind: HorizontalPodAutoscaler" in yaml and "nvidia.com/gpu: 2" in yaml
    assert f"replicas: {plan.replicas}" in yaml
    assert ranking_csv([plan]).splitlines()[0].startswith("gpu,tp,pp,replicas")


def _parser():
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    return parser


def test_cli_evaluate_json(capsys):
    args = _parser().parse_args(["plan", "evaluate", "--model", "Llama-3.1-8B", "--gpu", "H100",
                                 "--input-len", "500", "--output-len", "100", "--concurrency",
                                 "8", "--num-requests", "64", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["throughput_tok_s"] > 0 and out["memory_gb"] > 16
    assert set(out["ttft_ms"]) >= {"mean", "p50", "p99"} and out["cost_per_hour"] == 2.95


def test_cli_user_error_exit_2(capsys):
    args = _parser().parse_args(["plan", "search", "--model", "Lama-3.1-8B", "--rate", "1",
                                 "--input-len", "10", "--output-len", "10", "--ttft-p99-ms", "1",
                                 "--tpot-p99-ms", "1", "--json"])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert "did you mean 'Llama-3.1-8B'" in json.loads(captured.out)["error"]
    assert captured.err.count("\n") == 1


def test_cli_search_json_says_what_it_folded(capsys):
    args = _parser().parse_args(["plan", "search", "--model", "Llama-3.1-8B", "--rate", "4",
                                 "--input-len", "500", "--output-len", "100", "--ttft-p99-ms",
                                 "3000", "--tpot-p99-ms", "60", "--gpus", "L4", "--num-requests",
                                 "200", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"candidates", "pareto", "evaluated", "simulated", "folded", "seconds"} <= set(out)
    shapes = [(c["gpu"], c["weights"], c["kv"], c["tp"], c["pp"], str(c["spec_decode"]))
              for c in out["candidates"]]
    assert len(shapes) == len(set(shapes))
    assert sum(c["folded_variants"] for c in out["candidates"]) <= out["folded"]
    assert out["simulated"] >= len(out["pareto"]) >= 1
