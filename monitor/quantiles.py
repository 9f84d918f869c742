"""Prometheus' histogram_quantile, ported exactly, and windowed quantiles from bucket deltas."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Buckets = list[tuple[float, float]]
# Prometheus treats counts this close as equal so float noise does not bend the interpolation.
SMALL_DELTA_TOLERANCE = 1e-12


def _coalesce(buckets: Buckets) -> Buckets:
    out: Buckets = []
    for bound, count in buckets:
        if out and out[-1][0] == bound:
            out[-1] = (bound, out[-1][1] + count)
        else:
            out.append((bound, count))
    return out


def _almost_equal(a: float, b: float, tolerance: float) -> bool:
    # Prometheus' util/almost.Equal.
    min_normal = 2.2250738585072014e-308
    if a == b:
        return True
    abs_sum, diff = abs(a) + abs(b), abs(a - b)
    if a == 0 or b == 0 or abs_sum < min_normal:
        return diff < tolerance * min_normal
    return diff / min(abs_sum, 1.7976931348623157e308) < tolerance


def _ensure_monotonic(buckets: Buckets) -> Buckets:
    out = [buckets[0]]
    prev = buckets[0][1]
    for bound, count in buckets[1:]:
        if count != prev and (_almost_equal(prev, count, SMALL_DELTA_TOLERANCE) or count < prev):
            out.append((bound, prev))
            continue
        out.append((bound, count))
        prev = count
    return out


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The q-quantile of cumulative (upper_bound, count) buckets, as PromQL computes it."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(((float(b), float(c)) for b, c in buckets), key=lambda bc: bc[0])
    if not ordered or not math.isinf(ordered[-1][0]) or ordered[-1][0] < 0:
        return math.nan
    ordered = _ensure_monotonic(_coalesce(ordered))
    if len(ordered) < 2:
        return math.nan
    observations = ordered[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next((i for i in range(len(ordered) - 1) if ordered[i][1] >= rank), len(ordered) - 1)
    if b == len(ordered) - 1:
        # Above every finite bound: Prometheus answers with the highest finite bound, a floor.
        return ordered[-2][0]
    if b == 0 and ordered[0][0] <= 0:
        return ordered[0][0]
    start, end, count = 0.0, ordered[b][0], ordered[b][1]
    if b > 0:
        start = ordered[b - 1][0]
        count -= ordered[b - 1][1]
        rank -= ordered[b - 1][1]
    return start + (end - start) * (rank / count)


def quantile_interval(q: float, buckets: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """The bucket (lower, upper] holding histogram_quantile's q-quantile: the only values the
    true quantile can take (upper may be +Inf: above every finite bound; NaNs when there is
    no estimate)."""
    ordered = sorted(((float(b), float(c)) for b, c in buckets), key=lambda bc: bc[0])
    if (math.isnan(q) or not 0 <= q <= 1 or len(ordered) < 2 or not math.isinf(ordered[-1][0])
            or ordered[-1][1] == 0):
        return math.nan, math.nan
    ordered = _ensure_monotonic(_coalesce(ordered))
    rank = q * ordered[-1][1]
    b = next((i for i in range(len(ordered) - 1) if ordered[i][1] >= rank), len(ordered) - 1)
    if b == 0:
        upper = ordered[0][0]
        return (upper, upper) if upper <= 0 else (0.0, upper)
    return ordered[b - 1][0], ordered[b][0]


def counter_delta(before: float, after: float) -> float:
    """The increase of a counter between two readings; a drop means a restart, so count from 0."""
    return after if after < before else after - before


def bucket_deltas(before: Mapping[float, float], after: Mapping[float, float]) -> Buckets:
    """Per-bucket increases of one histogram series between two scrapes, with reset handling."""
    # A reset shows up as any bucket going down; then every bucket restarted from zero.
    reset = any(after[le] < before.get(le, 0.0) for le in after)
    return sorted((le, after[le] if reset else after[le] - before.get(le, 0.0)) for le in after)


def sum_by_le(series: Iterable[Buckets]) -> Buckets:
    """Add bucket lists of several label sets together, like `sum by (le)`."""
    total: dict[float, float] = {}
    for buckets in series:
        for le, count in buckets:
            total[le] = total.get(le, 0.0) + count
    return sorted(total.items())
