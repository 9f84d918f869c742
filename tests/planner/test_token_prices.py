"""$ per 1M input and per 1M output tokens: the hour's cost split by the GPU time prompts and
generated tokens take (issue #19: input and output priced apart)."""

from __future__ import annotations

import pytest

from planner.calibrate import Calibration
from planner.catalog import load_catalog
from planner.evaluate import evaluate, evaluation_dict, token_prices
from planner.replica import memory_for
from planner.screen import input_time_share
from planner.search import SearchSpace, search
from planner.timing import Deployment, StepCost
from planner.workload import Slo, Workload


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _d(catalog, **kw) -> Deployment:
    return Deployment(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"), max_seqs=64, **kw)


def test_the_two_prices_add_up_to_the_hour(catalog):
    w = Workload(500, 100, rate=4, slo=Slo(3000, 60), num_requests=200)
    d = _d(catalog)
    inp, out = token_prices(d, w, 2, memory_for(d, w), Calibration(), 5.0)
    per_hour = (inp * w.rate * w.input_len + out * w.rate * w.output_len) * 3600 / 1e6
    assert per_hour == pytest.approx(5.0)
    assert 0 < inp < out  # a prompt token costs one batched forward pass; an output token more


def test_the_input_share_follows_the_work(catalog):
    cost = StepCost(_d(catalog))
    short, long_ = Workload(200, 200, rate=4), Workload(4000, 200, rate=4)
    assert input_time_share(cost, short, 16) < input_time_share(cost, long_, 16)
    # A bigger decode batch spreads each decode step's weight reads over more tokens: output
    # tokens get cheaper, so prompts take a larger share of the time.
    assert input_time_share(cost, short, 4) < input_time_share(cost, short, 64)
    assert 0.0 < input_time_share(cost, long_, 64) < 1.0


def test_plans_and_evaluations_carry_both_prices(catalog):
    w = Workload(1000, 200, rate=2, slo=Slo(3000, 80), num_requests=100)
    space = SearchSpace(gpus=("H100 SXM",), weights=("bf16",), kv=("bf16",), tp=(1,), pp=(1,),
                        max_seqs=(64,), spec=(None,))
    row = search(catalog.model("Llama-3.1-8B"), w, catalog, space).candidates[0].as_dict()
    assert 0 < row["cost_per_1m_input_tokens"] < row["cost_per_1m_output_tokens"]
    ev = evaluation_dict(evaluate(_d(catalog), w))
    assert 0 < ev["cost_per_1m_input_tokens"] < ev["cost_per_1m_output_tokens"]
