"""The reads the panes need: a window of a series, request percentiles, runs and their summaries."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import sqlalchemy as sa

from storage.db import Database
from storage.models import (
    Alert,
    RequestRow,
    Rollup1h,
    Rollup1m,
    Run,
    SavedPlan,
    Series,
    Source,
    VerdictRow,
)
from storage.models import Sample as SampleRow

PERCENTILES = (50, 95, 99)
LATENCY_FIELDS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def pick_resolution(span_s: float) -> str:
    """Raw samples up to 2 hours, minute rollups up to 3 days, hour rollups beyond."""
    if span_s <= 2 * 3600:
        return "raw"
    return "1m" if span_s <= 3 * 86400 else "1h"


def series_window(db: Database, key: str, start_s: float, end_s: float,
                  resolution: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Timestamps (s) and values of a series in [start_s, end_s]; rollups give bucket means."""
    if resolution == "auto":
        resolution = pick_resolution(end_s - start_s)
    model = {"raw": SampleRow, "1m": Rollup1m, "1h": Rollup1h}[resolution]
    t = model.__table__
    width = {"raw": 1, "1m": 60_000, "1h": 3_600_000}[resolution]
    # A rollup row is stamped with its bucket's start, so include the bucket holding start_s.
    start_ms = int(start_s * 1000) // width * width
    value = t.c.value if model is SampleRow else t.c.total / t.c.count
    stmt = (sa.select(t.c.ts_ms, value).join(Series.__table__, Series.id == t.c.series_id)
            .where(Series.key == key, t.c.ts_ms >= start_ms,
                   t.c.ts_ms <= int(end_s * 1000)).order_by(t.c.ts_ms))
    with db.engine.connect() as conn:
        rows = conn.execute(stmt).all()
    if not rows:
        return np.empty(0), np.empty(0)
    data = np.asarray(rows, dtype=float)
    return data[:, 0] / 1000.0, data[:, 1]


def first_values(db: Database, key: str, count: int) -> list[float]:
    """The `count` oldest stored raw values of a series (fewer if it has fewer)."""
    t = SampleRow.__table__
    stmt = (sa.select(t.c.value).join(Series.__table__, Series.id == t.c.series_id)
            .where(Series.key == key).order_by(t.c.ts_ms).limit(count))
    with db.engine.connect() as conn:
        return [float(v) for v in conn.execute(stmt).scalars()]


ACCEPTANCE_AT = "spec_acceptance_rate_at[position="
ACCEPTED_AT = "spec_accepted_tokens_at_total[position="
DRAFTS = "spec_drafts_total"


def acceptance_by_position(db: Database, source: str, start_s: float = 0.0,
                           end_s: float = float("inf")) -> list[float]:
    """A source's speculative acceptance at each draft position (vLLM's definition: accepted
    at position i per draft), position 0 first, over what it stored in [start_s, end_s]; []
    where it stored none (it did not speculate, or was not monitored).

    From its counters where it stored them (a server's: every draft counted once, whenever it
    came, the first reading's count since the server started included); else the plain mean
    of its stored acceptance readings (the embedded engine stores only those, one per window
    that drafted)."""
    keys = list_series(db, source)
    drafts = _counter_total(db, f"{source}/{DRAFTS}", start_s, end_s) \
        if f"{source}/{DRAFTS}" in keys else 0.0
    if drafts > 0:
        totals = _positions(keys, f"{source}/{ACCEPTED_AT}")
        return [float(_counter_total(db, key, start_s, end_s) / drafts) for key in totals]
    rates = []
    for key in _positions(keys, f"{source}/{ACCEPTANCE_AT}"):
        mean = _mean_value(db, key, start_s, end_s)
        if mean is None:
            break
        rates.append(mean)
    return rates


def _positions(keys: list[str], prefix: str) -> list[str]:
    """The keys `prefix` + "N]" for N = 0, 1, ... up to the first missing position."""
    found = {int(k[len(prefix):-1]): k for k in keys
             if k.startswith(prefix) and k.endswith("]") and k[len(prefix):-1].isdigit()}
    out = []
    while len(out) in found:
        out.append(found[len(out)])
    return out


def _mean_value(db: Database, key: str, start_s: float, end_s: float) -> float | None:
    """A series' mean in [start_s, end_s]: of its raw samples where any are stored there, else
    (retention has rolled them up) of its minute buckets, else its hour buckets (total over
    count)."""
    for model in (SampleRow, Rollup1m, Rollup1h):
        t = model.__table__
        value = (sa.func.avg(t.c.value) if model is SampleRow
                 else sa.func.sum(t.c.total) / sa.func.sum(t.c.count))
        stmt = (sa.select(value).join(Series.__table__, Series.id == t.c.series_id)
                .where(Series.key == key, t.c.ts_ms >= int(start_s * 1000)))
        if end_s != float("inf"):
            stmt = stmt.where(t.c.ts_ms <= int(end_s * 1000))
        with db.engine.connect() as conn:
            mean = conn.execute(stmt).scalar()
        if mean is not None:
            return float(mean)
    return None


def counter_increase(values: np.ndarray) -> float:
    """How much a counter's readings rose, in order: a fall is a restart, whose new count is
    what it counted since."""
    steps = np.diff(values)
    return float(np.where(steps >= 0, steps, values[1:]).sum())


def _counter_total(db: Database, key: str, start_s: float, end_s: float) -> float:
    """What a counter counted by the end of [start_s, end_s]: its first raw reading there (its
    count since the server started) plus every rise after it (counter_increase)."""
    _, values = series_window(db, key, start_s, min(end_s, 4e9), "raw")
    return float(values[0]) + counter_increase(values) if len(values) else 0.0


def sources_with_acceptance(db: Database) -> list[str]:
    """The stored sources that measured speculative acceptance by draft position."""
    return [s["name"] for s in list_sources(db)
            if any(ACCEPTANCE_AT in key or ACCEPTED_AT in key
                   for key in list_series(db, s["name"]))]


def list_sources(db: Database) -> list[dict]:
    """Every stored source: name, kind (detected or configured), version, URL, dollars/hour."""
    t = Source.__table__
    stmt = sa.select(t.c.name, t.c.kind, t.c.version, t.c.url, t.c.dollars_per_hour)
    with db.engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(stmt.order_by(t.c.name))]


def list_series(db: Database, source: str | None = None) -> list[str]:
    """Every stored series key, optionally of one source."""
    stmt = sa.select(Series.key).order_by(Series.key)
    if source is not None:
        stmt = stmt.join(Source, Source.id == Series.source_id).where(Source.name == source)
    with db.engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def describe(values: list[float] | np.ndarray,
             percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float | int | None]:
    """Mean, count and the given percentiles (linear interpolation, as numpy and vLLM do)."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    out["mean"] = float(arr.mean()) if arr.size else None
    for p in percentiles:
        out[f"p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def _latency_summary(rows: list[Any]) -> dict[str, dict]:
    ok = [r for r in rows if r.ok]
    pooled_itl = [x for r in ok for x in (r.itl_ms or [])]
    return {
        "ttft_ms": describe([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": describe([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": describe(pooled_itl),
        "e2e_ms": describe([r.e2e_ms for r in ok if r.e2e_ms is not None]),
    }


def request_percentiles(db: Database, start_s: float, end_s: float,
                        source: str | None = None) -> dict[str, dict]:
    """TTFT, TPOT, pooled ITL and E2E percentiles of successful requests finished in a window."""
    t = RequestRow.__table__
    stmt = sa.select(t).where(t.c.ts_ms >= int(start_s * 1000), t.c.ts_ms <= int(end_s * 1000))
    if source is not None:
        stmt = stmt.join(Source.__table__, Source.id == t.c.source_id).where(Source.name == source)
    with db.engine.connect() as conn:
        rows = conn.execute(stmt).all()
    summary = _latency_summary(rows)
    summary["completed"] = sum(1 for r in rows if r.ok)
    summary["failed"] = sum(1 for r in rows if not r.ok)
    return summary


def save_run(db: Database, kind: str, name: str, config: dict, summary: dict,
             started_s: float, finished_s: float | None = None) -> int:
    """Store a run's configuration and summary; returns its id for its request records."""
    with db.session() as s:
        run = Run(kind=kind, name=name, config=config, summary=summary,
                  started_ms=int(started_s * 1000),
                  finished_ms=None if finished_s is None else int(finished_s * 1000))
        s.add(run)
        s.flush()
        return run.id


def finish_run(db: Database, run_id: int, summary: dict, finished_s: float | None = None) -> None:
    """Record a run's end time and final summary."""
    finished_ms = int((finished_s or time.time()) * 1000)
    with db.engine.begin() as conn:
        conn.execute(sa.update(Run.__table__).where(Run.id == run_id)
                     .values(summary=summary, finished_ms=finished_ms))


def list_runs(db: Database, kind: str | None = None) -> list[dict]:
    """Runs, newest first, without their request records."""
    stmt = sa.select(Run.__table__).order_by(Run.started_ms.desc())
    if kind is not None:
        stmt = stmt.where(Run.kind == kind)
    with db.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(stmt)]


def run_summary(db: Database, run_id: int) -> dict:
    """A run's stored fields plus latency percentiles recomputed from its request records."""
    with db.engine.connect() as conn:
        run = conn.execute(sa.select(Run.__table__).where(Run.id == run_id)).first()
        if run is None:
            raise KeyError(f"no run with id {run_id}")
        rows = conn.execute(sa.select(RequestRow.__table__)
                            .where(RequestRow.run_id == run_id)).all()
    out = dict(run._mapping)
    out["requests"] = _latency_summary(rows)
    out["completed"] = sum(1 for r in rows if r.ok)
    out["failed"] = sum(1 for r in rows if not r.ok)
    return out


def save_alert(db: Database, event: Any) -> None:
    """Store an alert event (monitor.alerts.AlertEvent: a rule firing or clearing)."""
    with db.engine.begin() as conn:
        conn.execute(sa.insert(Alert.__table__).values(
            rule=event.rule, series=event.series, state=event.state, ts_ms=int(event.ts * 1000),
            value=event.value, threshold=event.threshold, message=event.message))


def list_alerts(db: Database) -> list[dict]:
    """Stored alert events, oldest first."""
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(Alert.__table__).order_by(Alert.ts_ms, Alert.id))
        return [dict(r._mapping) for r in rows]


def save_plan(db: Database, name: str, plan: dict) -> int:
    """Keep a planner result under a name."""
    with db.session() as s:
        row = SavedPlan(name=name, plan=plan, created_ms=int(time.time() * 1000))
        s.add(row)
        s.flush()
        return row.id


def list_plans(db: Database) -> list[dict]:
    """Saved planner results, newest first (id breaks ties within one millisecond)."""
    t = SavedPlan.__table__
    stmt = sa.select(t).order_by(t.c.created_ms.desc(), t.c.id.desc())
    with db.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(stmt)]


def samples_span(db: Database, source: str | None = None) -> tuple[float, float] | None:
    """The first and last raw sample time (s) of every series (or one source's), or None."""
    t = SampleRow.__table__
    stmt = sa.select(sa.func.min(t.c.ts_ms), sa.func.max(t.c.ts_ms))
    if source is not None:
        stmt = (stmt.join(Series.__table__, Series.id == t.c.series_id)
                .join(Source.__table__, Source.id == Series.source_id)
                .where(Source.name == source))
    with db.engine.connect() as conn:
        first, last = conn.execute(stmt).one()
    return None if first is None else (first / 1000.0, last / 1000.0)


def save_verdicts(db: Database, verdicts: list[dict],
                  evaluated_s: float | None = None) -> list[int]:
    """Store diagnosis verdicts (monitor.diagnosis.Verdict.to_dict()); a verdict of the same rule
    on the same server or GPU whose stored span it overlaps or touches extends that row (one row
    per episode) instead of adding one. Returns the rows' ids."""
    t = VerdictRow.__table__
    evaluated_ms = int((time.time() if evaluated_s is None else evaluated_s) * 1000)
    ids = []
    with db.engine.begin() as conn:
        for v in verdicts:
            start_ms, end_ms = int(v["start"] * 1000), int(v["end"] * 1000)
            fields = {"title": v["title"], "advice": v["advice"], "kind": v["kind"],
                      "evidence": v["evidence"], "evaluated_ms": evaluated_ms}
            same = (t.c.rule == v["rule"]) & (t.c.source == v["source"]) & (t.c.gpu == v["gpu"])
            row = conn.execute(sa.select(t.c.id, t.c.start_ms, t.c.end_ms)
                               .where(same, t.c.end_ms >= start_ms, t.c.start_ms <= end_ms)
                               .order_by(t.c.end_ms.desc()).limit(1)).first()
            if row is None:
                ids.append(conn.execute(sa.insert(t).values(
                    rule=v["rule"], source=v["source"], gpu=v["gpu"], start_ms=start_ms,
                    end_ms=end_ms, **fields)).inserted_primary_key[0])
                continue
            conn.execute(sa.update(t).where(t.c.id == row.id).values(
                start_ms=min(row.start_ms, start_ms), end_ms=max(row.end_ms, end_ms), **fields))
            ids.append(row.id)
    return ids


def list_verdicts(db: Database, source: str | None = None) -> list[dict]:
    """Stored verdicts, newest episode first, in Verdict.to_dict()'s shape plus id and
    evaluated (s)."""
    t = VerdictRow.__table__
    stmt = sa.select(t).order_by(t.c.end_ms.desc(), t.c.id.desc())
    if source is not None:
        stmt = stmt.where(t.c.source == source)
    with db.engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [{"id": r.id, "rule": r.rule, "kind": r.kind, "source": r.source, "gpu": r.gpu,
             "title": r.title, "advice": r.advice, "start": r.start_ms / 1000.0,
             "end": r.end_ms / 1000.0, "evaluated": r.evaluated_ms / 1000.0,
             "evidence": r.evidence} for r in rows]
