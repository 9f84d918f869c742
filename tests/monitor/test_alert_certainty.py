"""An SLO alert on a histogram quantile says whether the breach is certain or only possible."""

from __future__ import annotations

from monitor.alerts import AlertEvaluator, AlertRule
from monitor.hub import Hub
from monitor.types import Sample


def _fire(lo: float) -> list:
    hub = Hub()
    rule = AlertRule("p99 TTFT", "s/ttft_s_p99", threshold=0.2, window_s=10)
    events = []
    alerts = AlertEvaluator([rule], on_event=events.append)
    hub._store([Sample("s/ttft_s_p99", 1.0, 0.235), Sample("s/ttft_s_p99_lo", 1.0, lo),
                Sample("s/ttft_s_p99_hi", 1.0, 0.25)], [])
    alerts.evaluate(hub, 1.0)
    return events


def test_a_bucket_wholly_above_the_slo_is_a_certain_breach():
    (event,) = _fire(lo=0.2)
    assert event.certainty == "certain" and "certain: its histogram bucket starts at 0.2" in \
        event.message


def test_a_bucket_straddling_the_slo_is_only_a_possible_breach():
    (event,) = _fire(lo=0.1)
    assert event.certainty == "possible" and "may still meet it" in event.message


def test_an_exact_series_says_neither():
    hub = Hub()
    events = []
    alerts = AlertEvaluator([AlertRule("e", "s/ttft", threshold=0.2)], on_event=events.append)
    hub._store([Sample("s/ttft", 1.0, 0.3)], [])
    alerts.evaluate(hub, 1.0)
    assert events[0].certainty is None and "certain" not in events[0].message
