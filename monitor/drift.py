"""Output drift: a server's response lengths and finish reasons, window by window, against the
source's own baseline.

The baseline is the distribution of the first `baseline_requests` requests the monitor saw
finish on the source (or one stored by an earlier session); each window's distribution is then
compared with it by the population stability index (PSI = sum (p - q) ln(p / q), the symmetric
Kullback-Leibler divergence ML monitoring uses for feature and prediction drift: 0.1 moderate,
0.25 significant). A small window's PSI is large by chance alone: sample noise makes
PSI * n1 n2 / (n1 + n2) about chi-square with k - 1 degrees of freedom (k categories), so a
window is judged against the larger of 0.25 and the 99th percentile of that noise. The
`*_drift` series is PSI over that bar: above 1, the drift is significant and not sampling noise.

Response lengths come from the server's `vllm:request_generation_tokens` histogram (one
category per bucket), finish reasons from `vllm:request_success_total{finished_reason}`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from monitor.alerts import AlertRule

PSI_MODERATE = 0.1
PSI_SIGNIFICANT = 0.25
Z_99 = 2.3263478740408408  # the standard normal's 99th percentile
DEFAULT_BASELINE_REQUESTS = 100
DEFAULT_MIN_WINDOW_REQUESTS = 20

# What is compared: the drift's name -> what its categories are, for messages and charts.
DRIFTS = {"response_length": "response lengths (tokens)", "finish_reason": "finish reasons"}


def psi(baseline: Mapping[str, float], current: Mapping[str, float]) -> float:
    """The population stability index of `current` against `baseline` (counts per category).
    Each share is smoothed by half a count (a category empty on one side would otherwise make
    it infinite)."""
    keys = set(baseline) | set(current)
    p, q = _shares(baseline, keys), _shares(current, keys)
    return sum((q[k] - p[k]) * math.log(q[k] / p[k]) for k in keys)


def _shares(counts: Mapping[str, float], keys: Iterable[str]) -> dict[str, float]:
    keys = list(keys)
    total = sum(counts.get(k, 0.0) for k in keys) + 0.5 * len(keys)
    return {k: (counts.get(k, 0.0) + 0.5) / total for k in keys}


def chi2_quantile_99(df: int) -> float:
    """The chi-square distribution's 99th percentile (Wilson-Hilferty: within 1% for df >= 2,
    within 10% at df = 1, which is enough for a noise bar)."""
    if df < 1:
        return 0.0
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_99 * math.sqrt(a)) ** 3


def noise_bar(baseline: Mapping[str, float], current: Mapping[str, float]) -> float:
    """The PSI that sampling alone stays under 99% of the time, for these sample sizes."""
    n1, n2 = sum(baseline.values()), sum(current.values())
    if n1 <= 0 or n2 <= 0:
        return math.inf
    k = sum(1 for key in set(baseline) | set(current)
            if baseline.get(key, 0) + current.get(key, 0) > 0)
    return chi2_quantile_99(k - 1) * (1.0 / n1 + 1.0 / n2)


@dataclass
class _Tracked:
    baseline: dict[str, float] = field(default_factory=dict)
    fixed: bool = False
    window: deque = field(default_factory=deque)  # (ts, counts)


class OutputDrift:
    """Per drift name: the baseline (learnt from the first requests, or given) and a sliding
    window of per-scrape counts; `observe` returns the series to emit."""

    def __init__(self, window_s: float = 60.0, baselines: Mapping[str, Mapping] | None = None,
                 baseline_requests: int = DEFAULT_BASELINE_REQUESTS,
                 min_window_requests: int = DEFAULT_MIN_WINDOW_REQUESTS) -> None:
        if baseline_requests < 1 or min_window_requests < 1:
            raise ValueError("the drift baseline and window need at least one request")
        self.window_s = window_s
        self.baseline_requests = baseline_requests
        self.min_window_requests = min_window_requests
        self._tracked: dict[str, _Tracked] = {}
        for name, counts in (baselines or {}).items():
            if sum(counts.values()) > 0:
                self._tracked[name] = _Tracked(dict(counts), fixed=True)

    def baseline(self, name: str) -> dict[str, float] | None:
        tracked = self._tracked.get(name)
        return dict(tracked.baseline) if tracked is not None and tracked.fixed else None

    def observe(self, name: str, counts: Mapping[str, float], now: float
                ) -> list[tuple[str, float]]:
        """Counts per category of the requests finished since the last scrape."""
        tracked = self._tracked.setdefault(name, _Tracked())
        counts = {k: v for k, v in counts.items() if v > 0}
        tracked.window.append((now, counts))
        while tracked.window and tracked.window[0][0] <= now - self.window_s:
            tracked.window.popleft()
        out = []
        if not tracked.fixed:
            for k, v in counts.items():
                tracked.baseline[k] = tracked.baseline.get(k, 0.0) + v
            if sum(tracked.baseline.values()) < self.baseline_requests:
                return []
            tracked.fixed = True
            # Stored once, as series: a later session reads its baseline back from them.
            out += [(f"{name}_baseline[{k}]", v) for k, v in sorted(tracked.baseline.items())]
        window: dict[str, float] = {}
        for _, c in tracked.window:
            for k, v in c.items():
                window[k] = window.get(k, 0.0) + v
        if sum(window.values()) < self.min_window_requests:
            return out
        value = psi(tracked.baseline, window)
        bar = max(PSI_SIGNIFICANT, noise_bar(tracked.baseline, window))
        return out + [(f"{name}_psi", value), (f"{name}_drift", value / bar)]


def bucket_counts(cumulative: Iterable[tuple[float, float]]) -> dict[str, float]:
    """Per-bucket counts, keyed by the bucket's upper bound ("5", "10", "inf"), from a
    histogram's cumulative (le, count) pairs in ascending order."""
    out, below = {}, 0.0
    for le, count in cumulative:
        out["inf" if math.isinf(le) else f"{le:g}"] = max(0.0, count - below)
        below = max(below, count)
    return out


def stored_baselines(keys_and_values: Iterable[tuple[str, float]]) -> dict[str, dict]:
    """Baselines from stored `<name>_baseline[<category>]` series (source prefix removed)."""
    out: dict[str, dict] = {}
    for key, value in keys_and_values:
        for name in DRIFTS:
            prefix = f"{name}_baseline["
            if key.startswith(prefix) and key.endswith("]"):
                out.setdefault(name, {})[key[len(prefix):-1]] = value
    return out


def load_baselines(db, source: str) -> dict[str, dict]:
    """The drift baselines an earlier session stored for `source` (as
    `<source>/<drift>_baseline[<category>]` series, their first values), or {} to learn them
    again. A database error (SQLAlchemyError) is the caller's to report."""
    from storage.queries import first_values, list_series

    prefix = f"{source}/"
    keys = [k for k in list_series(db, source) if k.startswith(prefix) and "_baseline[" in k]
    return stored_baselines((k[len(prefix):], v) for k in keys for v in first_values(db, k, 1))


def drift_rules(sources: Iterable[str], window_s: float = 60.0) -> list[AlertRule]:
    """An alert per source and drift when the window's PSI is above its bar (drift > 1)."""
    return [AlertRule(f"{name} {what} drift", f"{name}/{drift}_drift", 1.0, window_s=window_s)
            for name in sources for drift, what in DRIFTS.items()]
