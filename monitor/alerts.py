"""SLO alert rules over live series: fire after a sustained breach, clear when it ends."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlertRule:
    """Breach when the window's percentile (or mean) of a series is above the threshold."""

    name: str
    series: str
    threshold: float
    window_s: float = 60.0
    percentile: float | None = None  # e.g. 99 for p99 of the window's values; None for the mean
    for_s: float = 0.0  # how long the breach must last before the alert fires

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.for_s < 0:
            raise ValueError(f"alert {self.name!r}: window must be positive, duration not negative")
        if self.percentile is not None and not 0 <= self.percentile <= 100:
            raise ValueError(f"alert {self.name!r}: percentile must be within 0-100")


@dataclass(frozen=True)
class AlertEvent:
    """A rule changing state: "firing" or "cleared"."""

    rule: str
    series: str
    state: str
    ts: float
    value: float | None
    threshold: float
    message: str
    # For a quantile estimated from a histogram: "certain" when the bucket it lies in starts
    # at or above the threshold, "possible" when only the estimate is above; else None.
    certainty: str | None = None


# The SLO series of a server: TPOT is judged on ITL too, the only one some servers report.
SLO_SERIES = (("ttft", ("ttft_s_p99",)), ("tpot", ("tpot_s_p99", "itl_s_p99")))


def slo_rules(sources: Iterable[str], slo_ms: dict[str, float | None],
              window_s: float) -> list[AlertRule]:
    """p99 TTFT / TPOT rules for each source; an objective that is None or absent gets none."""
    rules = []
    for name in sources:
        for slo, metrics in SLO_SERIES:
            if slo_ms.get(slo) is None:
                continue
            rules += [AlertRule(f"{name} p99 {slo.upper()} ({m.split('_')[0]})", f"{name}/{m}",
                                slo_ms[slo] / 1000.0, window_s=window_s) for m in metrics]
    return rules


class AlertEvaluator:
    """Evaluates rules against a hub's ring buffers on every hub tick."""

    def __init__(self, rules: Iterable[AlertRule],
                 on_event: Callable[[AlertEvent], None] | None = None) -> None:
        self.rules = list(rules)
        self.on_event = on_event
        self.events: list[AlertEvent] = []
        self._breach_since: dict[str, float] = {}
        self._firing: set[str] = set()

    @property
    def firing(self) -> list[str]:
        return sorted(self._firing)

    def value(self, rule: AlertRule, hub, now: float) -> float | None:
        _, values = hub.series(rule.series, since=now - rule.window_s)
        if not len(values):
            return None
        if rule.percentile is None:
            return float(np.mean(values))
        return float(np.percentile(values, rule.percentile))

    def lower_bound(self, rule: AlertRule, hub, now: float) -> float | None:
        """The window's value of the lower end of the estimate's bucket, where the series is a
        histogram quantile that carries one (its `_lo` series)."""
        _, values = hub.series(rule.series + "_lo", since=now - rule.window_s)
        if not len(values):
            return None
        if rule.percentile is None:
            return float(np.mean(values))
        return float(np.percentile(values, rule.percentile))

    def evaluate(self, hub, now: float) -> None:
        for rule in self.rules:
            value = self.value(rule, hub, now)
            breached = value is not None and value > rule.threshold
            if breached:
                since = self._breach_since.setdefault(rule.name, now)
                if rule.name not in self._firing and now - since >= rule.for_s:
                    self._emit(rule, "firing", now, value, self.lower_bound(rule, hub, now))
            else:
                self._breach_since.pop(rule.name, None)
                if rule.name in self._firing:
                    self._emit(rule, "cleared", now, value)

    def _emit(self, rule: AlertRule, state: str, now: float, value: float | None,
              lower: float | None = None) -> None:
        if state == "firing":
            self._firing.add(rule.name)
        else:
            self._firing.discard(rule.name)
        what = "mean" if rule.percentile is None else f"p{rule.percentile:g}"
        shown = "no data" if value is None else f"{value:.4g}"
        message = (f"{rule.name}: {what} of {rule.series} over {rule.window_s:g} s is {shown} "
                   f"({'above' if state == 'firing' else 'back under'} {rule.threshold:g})")
        certainty = None
        if state == "firing" and lower is not None:
            certain = lower >= rule.threshold
            certainty = "certain" if certain else "possible"
            message += (f"; certain: its histogram bucket starts at {lower:.4g}, at or above "
                        f"the threshold" if certain else
                        f"; possible: its histogram bucket starts at {lower:.4g}, below the "
                        f"threshold, so the true value may still meet it")
        event = AlertEvent(rule.name, rule.series, state, now, value, rule.threshold, message,
                           certainty)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
