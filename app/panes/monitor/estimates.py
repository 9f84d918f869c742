"""A load test's exact percentiles (the client's clock, every request) beside the server's own
estimates for the same requests (histogram quantiles, with the bucket each lies in), for the
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


def stored_rows(run: dict) -> list[list[str]]:
    """Rows from the estimates the load test stored itself: the server's histograms over
    exactly the run's requests (monitor/run_window.py); [] for a run without them."""
    summary = run.get("summary") or {}
    server = summary.get("server") or {}
    rows = []
    for label, metric in METRICS:
        for p in PERCENTILES:
            got = (server.get(f"{metric}_ms") or {}).get(f"p{p}")
            if got is None:
                continue
            exact = (summary.get(f"{metric}_ms") or {}).get(f"p{p}")
            rows.append(_row(f"{label} p{p} (ms)", exact, got["estimate"], got.get("lo"),
                             got.get("hi")))
    return rows


def window_note(run: dict) -> str | None:
    """What to know of a run's stored server estimates: other clients' requests counted in
    them, or a server that had not counted every request when it was read."""
    summary = run.get("summary") or {}
    server = summary.get("server") or {}
    if "requests" not in server:
        return None
    counted, completed = server["requests"], summary.get("completed")
    if counted != completed:
        what = ("include other clients' requests" if counted > completed
                else "miss some of this run's requests")
        return (f"The server counted {counted} requests while run {run['id']} completed "
                f"{completed}: its estimates {what}.")
    return None


def estimate_rows(db: Any, run: dict) -> tuple[str | None, list[list[str]]]:
    """(source, rows): for each latency and percentile, the run's exact value, the server's
    estimate, the bucket it lies in and the gap; (None, []) when no estimate is stored.

    A load test stores the server's estimates over exactly its own requests; for a run without
    them (older runs, a server read only by the monitor), the monitor's stored estimate just
    after the run stands in (over its sliding window, a minute for vLLM-style sources)."""
    rows = stored_rows(run)
    if rows:
        server = run["summary"]["server"]
        return server_name(db, run) or server.get("url") or run["name"], rows
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
            ms = [None if v is None else v * 1000 for v in (estimate, lo, hi)]  # stored in s
            rows.append(_row(f"{label} p{p} (ms)", exact, *ms))
    return source, rows


def _row(metric: str, exact: float | None, estimate: float, lo: float | None,
         hi: float | None) -> list[str]:
    """One comparison row, every figure in ms: exact, estimate, its bucket, their gap."""
    return [metric, fmt(exact), fmt(estimate), _bucket(lo, hi),
            "" if exact is None else fmt(estimate - exact)]


def _bucket(lo: float | None, hi: float | None) -> str:
    """The bucket (lo, hi] in ms as text."""
    if lo is None or not math.isfinite(lo):
        return "—"
    if hi is None:  # the last bucket: no upper bound
        return f"above {fmt(lo)} ms"
    return f"{fmt(lo)}–{fmt(hi)} ms"
