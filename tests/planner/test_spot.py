"""Spot interruptions simulated: reclaim rates from the dated catalog, the cold start from its
parts, requests drained, lost or migrated, and pools sized so the p99 SLOs hold through it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.catalog import load_catalog
from planner.memory import GB, weight_bytes
from planner.search import SearchSpace, search
from planner.simulate import Replica
from planner.spot import (
    HOURS_PER_MONTH,
    IMAGE_GB,
    STORAGE_GBS,
    ColdStart,
    SpotMarket,
    load_spot_markets,
    plan_spot,
    simulate_pool,
)
from planner.timing import Deployment
from planner.workload import Slo, Workload


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_every_shipped_market_says_where_its_figures_come_from():
    markets = load_spot_markets()
    assert ("H100 SXM", "aws") in markets
    catalog = load_catalog()
    for (gpu, _provider), m in markets.items():
        catalog.gpu(gpu)  # names a catalog GPU
        assert m.source and m.date and m.notice_source and m.instance
        assert 0 < m.monthly_low <= m.monthly_high < 1


def test_monthly_reclaim_share_becomes_a_rate_that_reproduces_it():
    m = load_spot_markets()["H100 SXM", "aws"]
    rate = m.hazard_per_hour()
    mid = (m.monthly_low + m.monthly_high) / 2
    assert 1 - math.exp(-rate * HOURS_PER_MONTH) == pytest.approx(mid, rel=1e-12)


def test_a_users_spot_file_overrides_the_shipped_rate(tmp_path):
    (tmp_path / "catalogs").mkdir()
    (tmp_path / "catalogs" / "spot.toml").write_text(
        '[spot."H100 SXM".aws]\ninstance = "p5.48xlarge"\nmonthly_low = 0.01\n'
        'monthly_high = 0.02\nsource = "our own fleet, 2026-11"\ndate = "2026-11-30"\n'
        'notice_s = 120\nnotice_source = "AWS EC2 User Guide"\n')
    assert load_spot_markets(tmp_path)["H100 SXM", "aws"].monthly_high == 0.02


def test_cold_start_is_image_and_weights_over_the_storage(catalog):
    d = Deployment(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"))
    expected = (IMAGE_GB + weight_bytes(d.model, "bf16") / GB) / STORAGE_GBS
    assert ColdStart().seconds(d) == pytest.approx(expected)
    assert ColdStart(provisioning_s=60).seconds(d) == pytest.approx(expected + 60)


def _replica() -> Replica:
    return Replica(lambda *a: 0.02, max_seqs=32, max_batched_tokens=4096, kv_tokens=10**6)


def test_short_notice_loses_long_requests_unless_they_migrate():
    """Requests of 400 tokens at 20 ms a step take 8 s; a 1 s notice cuts those in flight."""
    w = Workload(64, 400, rate=4, slo=Slo(2000, 100), num_requests=400)
    lost = simulate_pool(_replica(), w, 3, (0,), at=30.0, notice_s=1.0, cold_s=5.0,
                         migrate=False)
    moved = simulate_pool(_replica(), w, 3, (0,), at=30.0, notice_s=1.0, cold_s=5.0)
    calm = simulate_pool(_replica(), w, 3)
    assert lost.lost > 0 and lost.migrated == 0
    assert moved.lost == 0 and moved.migrated == lost.lost
    assert np.isfinite(moved.tpot).all() and not np.isfinite(lost.tpot).all()
    assert calm.attainment() == 1.0
    assert lost.attainment(in_window=True) < moved.attainment(in_window=True) <= 1.0
    # Migrated requests pay their recompute and the gap: TPOT p99 in the window rises.
    assert moved.p99("tpot", True) > calm.p99("tpot")


def test_a_pool_cannot_lose_every_replica_at_once():
    w = Workload(64, 10, rate=2, num_requests=50)
    with pytest.raises(ValueError, match="keep at least one on demand"):
        simulate_pool(_replica(), w, 2, (0, 1), at=5.0, notice_s=1.0, cold_s=10.0)


@pytest.fixture(scope="module")
def l4_case(catalog):
    """Llama-3.1-8B FP8 on L4 (spot $0.44 against $0.78 on demand), 3 req/s."""
    w = Workload(1000, 200, rate=3, slo=Slo(ttft_p99_ms=2000, tpot_p99_ms=60), num_requests=400)
    best = search(catalog.model("Llama-3.1-8B"), w, catalog,
                  SearchSpace(gpus=("L4",), weights=("fp8",), kv=("fp8",), tp=(1,), pp=(1,),
                              spec=(None,))).candidates[0]
    market = load_spot_markets()["L4", "aws"]
    independent = plan_spot(best.deployment, w, best.replicas, market)
    correlated = plan_spot(best.deployment, w, best.replicas, market, correlated=True)
    return independent, correlated


def test_spot_pool_holds_the_slos_through_an_interruption_for_less(l4_case):
    (spot, on_demand), _ = l4_case
    assert spot.holds and on_demand.holds and on_demand.spot == 0
    assert spot.spot > 0 and spot.cost_per_hour < on_demand.cost_per_hour
    assert spot.ttft_p99_window_ms <= 2000 and spot.tpot_p99_window_ms <= 60
    assert spot.interruptions_per_month > 0
    assert 0.99 <= spot.attainment_long_run <= 1.0
    for p in (spot, on_demand):  # input and output priced apart
        assert p.cost_per_1m_input > 0 and p.cost_per_1m_output > 0
    assert spot.cost_per_1m_output < on_demand.cost_per_1m_output


def test_a_whole_pool_reclaimed_at_once_needs_on_demand_beside_the_spot(l4_case):
    (independent, baseline), (correlated, _) = l4_case
    assert correlated.holds and correlated.spot > 0 and correlated.on_demand > 0
    assert independent.cost_per_hour <= correlated.cost_per_hour <= baseline.cost_per_hour


def test_spot_market_for_another_gpu_is_refused_by_name(catalog):
    d = Deployment(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"))
    market = SpotMarket("L4", "aws", "g6f.xlarge", 0.05, 0.1, 120, "s", "2026-02-24", "n")
    with pytest.raises(ValueError, match="market is for L4.*runs on H100 SXM"):
        plan_spot(d, Workload(100, 10, rate=1, num_requests=20), 1, market)


def test_plan_search_spot_market_prints_the_pools_or_says_what_is_missing(capsys):
    import argparse
    import json
    import shlex

    from planner.cli import add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    base = ("plan search --model Llama-3.1-8B --input-len 1000 --output-len 200 --rate 3 "
            "--ttft-p99-ms 2000 --tpot-p99-ms 60 --num-requests 300 --top 1 --json "
            "--spot-market aws --gpus ")
    args = parser.parse_args(shlex.split(base + "L4"))
    assert args.func(args) == 0
    spot = json.loads(capsys.readouterr().out)["spot"]
    assert set(spot) == {"one_reclaimed", "all_spot_reclaimed_at_once", "on_demand"}
    assert spot["one_reclaimed"]["cost_per_hour"] <= spot["on_demand"]["cost_per_hour"]
    args = parser.parse_args(shlex.split(base + "4090"))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "no spot interruption rate for RTX 4090 at 'aws'" in err
