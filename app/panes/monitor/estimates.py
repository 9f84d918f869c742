"""A load test's exact percentiles (the client's clock, every request) beside the server's own
estimates for the same minutes (histogram quantiles, with the bucket each lies in), for the
History pane. No Qt: an import-linter contract keeps it so."""

from __future__ import annotations

import math
from typing import Any

from app.panes.monitor.state import fmt

METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"))
PERCENTILES = (50, 95, 99)
# The server's first scrape after the run's last request counts it: looked for this long.
SLACK_S = 5.0
COLUMNS = ("Metric", "Client (exact)", "Server estimate", "Its bucket", "Estimate − exact")


def server_name(db: Any, run: dict) -> str | None:
    """The monitored source a run loaded: the one named as the run (the app's load tests), else
    a saved server with the run's URL; None when the database holds neither."""
    import sqlalchemy as sa

    from storage.models import Source
    from storage.queries import list_series

    if list_series(db, run["name"]):
        return run["name"]
    url = (run.get("config") or {}).get("url")
    if not url:
        return None
    with db.engine.connect() as conn:
        names = conn.execute(sa.select(Source.name).where(
            Source.url.in_([url, url.rstrip("/"), url.rstrip("/") + "/metrics"]))).scalars()
        return next((n for n in names if list_series(db, n)), None)


def _point(db: Any, key: str, start_s: float, end_s: float,
           last: bool = True) -> tuple[float | None, float | None]:
    """(timestamp, value) of the last (or first) finite stored point of ``key`` in the span."""
    from storage.queries import series_window

    ts, values = series_window(db, key, start_s, end_s, resolution="raw")
    pairs = zip(ts[::-1], values[::-1], strict=True) if last else zip(ts, values, strict=True)
    for t, v in pairs:
        if math.isfinite(v):
            return float(t), float(v)
    return None, None


def _estimate(db: Any, key: str, start_s: float, end_s: float
              ) -> tuple[float | None, float | None]:
    """The server's estimate for a run: its first scrape after the run ended (its window holds
    the whole of a run shorter than that window), else its last one during the run."""
    at, value = _point(db, key, end_s, end_s + SLACK_S, last=False)
    return (at, value) if value is not None else _point(db, key, start_s, end_s)


def estimate_rows(db: Any, run: dict) -> tuple[str | None, list[list[str]]]:
    """(source, rows): for each latency and percentile, the run's exact value, the server's
    estimate just after the run (over its sliding window, a minute for vLLM-style sources),
    the bucket it lies in and the gap; (None, []) when no estimate is stored."""
    source = server_name(db, run)
    if source is None:
        return None, []
    start = run["started_ms"] / 1000
    end = (run.get("finished_ms") or run["started_ms"]) / 1000
    summary = run.get("summary") or {}
    rows = []
    for label, metric in METRICS:
        for p in PERCENTILES:
            key = f"{source}/{metric}_s_p{p}"
            at, estimate = _estimate(db, key, start, end)
            exact = (summary.get(f"{metric}_ms") or {}).get(f"p{p}")
            if estimate is None:
                continue
            _, lo = _point(db, key + "_lo", at - 0.001, at + 0.001)
            _, hi = _point(db, key + "_hi", at - 0.001, at + 0.001)
            rows.append([f"{label} p{p} (ms)", fmt(exact), fmt(estimate * 1000),
                         _bucket(lo, hi), "" if exact is None else fmt(estimate * 1000 - exact)])
    return source, rows


def _bucket(lo: float | None, hi: float | None) -> str:
    if lo is None:
        return "—"
    if hi is None:  # the last bucket: no upper bound
        return f"above {fmt(lo * 1000)} ms"
    return f"{fmt(lo * 1000)}–{fmt(hi * 1000)} ms"
