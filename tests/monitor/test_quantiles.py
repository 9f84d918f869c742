"""histogram_quantile on hand-computed buckets, and windowed quantiles from bucket deltas."""

from __future__ import annotations

import math

import pytest

from monitor.quantiles import (
    bucket_deltas,
    counter_delta,
    histogram_quantile,
    sum_by_le,
)

INF = float("inf")
B = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]


@pytest.mark.parametrize(("q", "expected"), [
    (0.1, 0.04),    # rank 4 in the lowest bucket: interpolated from 0
    (0.25, 0.1),    # rank 10 = the lowest bucket's count
    (0.5, 0.3),     # rank 20: 0.1 + 0.4 * (20 - 10) / (30 - 10)
    (0.99, 0.98),   # rank 39.6: 0.5 + 0.5 * 9.6 / 10
    (1.0, 1.0),
    (0.0, 0.0),
])
def test_interpolates_inside_the_bucket_holding_the_rank(q, expected):
    assert histogram_quantile(q, B) == pytest.approx(expected)


def test_rank_in_the_inf_bucket_returns_the_highest_finite_bound():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 50.0)]
    assert histogram_quantile(0.99, buckets) == 1.0      # rank 49.5 lies above le=1
    assert histogram_quantile(0.8, buckets) == pytest.approx(1.0)  # rank 40 ends the le=1 bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 15 / 20)


def test_order_duplicates_and_non_monotonic_counts_are_fixed_like_prometheus():
    shuffled = [(INF, 40.0), (1.0, 40.0), (0.1, 10.0), (0.5, 30.0)]
    assert histogram_quantile(0.5, shuffled) == pytest.approx(0.3)
    # Duplicate bounds are added together before the search.
    assert histogram_quantile(0.5, [(0.1, 5.0), (0.1, 5.0), (INF, 10.0)]) == pytest.approx(0.05)
    # A count lower than the bucket below it is raised to that count.
    dented = [(0.1, 10.0), (0.5, 8.0), (1.0, 20.0), (INF, 20.0)]
    assert histogram_quantile(0.5, dented) == pytest.approx(0.1)
    assert histogram_quantile(0.75, dented) == pytest.approx(0.75)


def test_edge_cases_return_what_prometheus_returns():
    assert math.isnan(histogram_quantile(0.5, [(0.1, 1.0), (1.0, 2.0)]))  # no +Inf bucket
    assert math.isnan(histogram_quantile(0.5, [(INF, 5.0)]))              # fewer than 2 buckets
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]))  # no observations
    assert math.isnan(histogram_quantile(0.5, []))
    assert math.isnan(histogram_quantile(math.nan, B))
    assert histogram_quantile(-0.1, B) == -INF
    assert histogram_quantile(1.1, B) == INF
    # A non-positive lowest bound is returned as is instead of interpolating from 0.
    assert histogram_quantile(0.2, [(-1.0, 5.0), (0.0, 10.0), (INF, 10.0)]) == -1.0


def _window(before, after, q: float) -> float:
    """A window's quantile the way the normaliser makes it: each series' bucket increases,
    summed by le, then histogram_quantile."""
    deltas = [bucket_deltas(before.get(key, {}), buckets) for key, buckets in after.items()]
    return histogram_quantile(q, sum_by_le(deltas))


def test_counter_delta_treats_a_drop_as_a_restart():
    assert counter_delta(10.0, 15.0) == 5.0
    assert counter_delta(10.0, 3.0) == 3.0


def test_window_quantiles_use_bucket_increases_between_scrapes():
    before = {"": {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, INF: 40.0}}
    after = {"": {0.1: 12.0, 0.5: 40.0, 1.0: 50.0, INF: 52.0}}
    assert bucket_deltas(before[""], after[""]) == [(0.1, 2.0), (0.5, 10.0), (1.0, 10.0),
                                                    (INF, 12.0)]
    assert _window(before, after, 0.5) == pytest.approx(0.1 + 0.4 * 4 / 8)   # rank 6 of 12
    assert _window(before, after, 0.99) == 1.0                                # 2 of 12 above


def test_window_quantiles_after_a_counter_reset_use_the_new_counts():
    before = {"": {0.1: 10.0, 0.5: 30.0, INF: 40.0}}
    after = {"": {0.1: 2.0, 0.5: 4.0, INF: 4.0}}      # the server restarted
    assert bucket_deltas(before[""], after[""]) == [(0.1, 2.0), (0.5, 4.0), (INF, 4.0)]
    assert _window(before, after, 0.5) == pytest.approx(0.1)


def test_series_are_summed_by_le_and_new_series_count_from_zero():
    before = {"engine=0": {0.1: 1.0, INF: 2.0}}
    after = {"engine=0": {0.1: 3.0, INF: 4.0}, "engine=1": {0.1: 0.0, INF: 2.0}}
    assert sum_by_le([bucket_deltas(before.get(k, {}), v) for k, v in after.items()]) == [
        (0.1, 2.0), (INF, 4.0)]
    # rank 2 of 4 ends the le=0.1 bucket
    assert _window(before, after, 0.5) == pytest.approx(0.1)
