"""1-minute and 1-hour rollups of the samples table, and the retention policy."""

from __future__ import annotations

import time
from dataclasses import dataclass

import sqlalchemy as sa

from storage.db import Database
from storage.models import Alert, RequestRow, Rollup1h, Rollup1m, Sample

MINUTE_MS = 60_000
HOUR_MS = 3_600_000


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each resolution is kept, in days."""

    raw_days: float = 7.0
    minute_days: float = 90.0
    hour_days: float = 730.0
    request_days: float = 90.0

    def __post_init__(self) -> None:
        if min(self.raw_days, self.minute_days, self.hour_days, self.request_days) <= 0:
            raise ValueError("retention periods must be positive")


def _rebuild(conn: sa.Connection, source, target, width_ms: int, start_ms: int,
             end_ms: int) -> None:
    # Buckets are recomputed whole (delete then insert-select) so late samples are counted.
    src = source.__table__
    bucket = (src.c.ts_ms // width_ms) * width_ms
    in_range = sa.and_(src.c.ts_ms >= start_ms, src.c.ts_ms < end_ms)
    tgt = target.__table__
    conn.execute(sa.delete(tgt).where(tgt.c.ts_ms >= start_ms, tgt.c.ts_ms < end_ms))
    if source is Sample:
        cols = [sa.func.count(), sa.func.sum(src.c.value), sa.func.min(src.c.value),
                sa.func.max(src.c.value)]
    else:
        cols = [sa.func.sum(src.c.count), sa.func.sum(src.c.total), sa.func.min(src.c.min),
                sa.func.max(src.c.max)]
    select = (sa.select(src.c.series_id, bucket.label("b"), *cols)
              .where(in_range).group_by(src.c.series_id, bucket))
    conn.execute(sa.insert(tgt).from_select(
        ["series_id", "ts_ms", "count", "total", "min", "max"], select))


def roll_up(db: Database, start_ms: int, end_ms: int) -> None:
    """Recompute the minute and hour rollups of every bucket overlapping [start_ms, end_ms)."""
    m0, m1 = start_ms // MINUTE_MS * MINUTE_MS, -(-end_ms // MINUTE_MS) * MINUTE_MS
    h0, h1 = start_ms // HOUR_MS * HOUR_MS, -(-end_ms // HOUR_MS) * HOUR_MS
    with db.engine.begin() as conn:
        _rebuild(conn, Sample, Rollup1m, MINUTE_MS, m0, m1)
        _rebuild(conn, Rollup1m, Rollup1h, HOUR_MS, h0, h1)


def apply_retention(db: Database, policy: RetentionPolicy, now_ms: int | None = None) -> None:
    """Delete raw samples, rollups, requests and alerts older than the policy keeps."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    day = 86_400_000
    cuts = [(Sample, policy.raw_days), (Rollup1m, policy.minute_days),
            (Rollup1h, policy.hour_days), (RequestRow, policy.request_days),
            (Alert, policy.hour_days)]
    with db.engine.begin() as conn:
        for model, days in cuts:
            table = model.__table__
            conn.execute(sa.delete(table).where(table.c.ts_ms < now_ms - int(days * day)))


class Maintenance:
    """The writer's periodic job: roll up what arrived since last time, then apply retention."""

    def __init__(self, policy: RetentionPolicy | None = None) -> None:
        self.policy = policy or RetentionPolicy()
        self._since_ms: int | None = None

    def __call__(self, db: Database) -> None:
        now_ms = int(time.time() * 1000)
        start = self._since_ms if self._since_ms is not None else now_ms - HOUR_MS
        roll_up(db, start, now_ms)
        apply_retention(db, self.policy, now_ms)
        self._since_ms = now_ms - MINUTE_MS
