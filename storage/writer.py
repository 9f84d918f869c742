"""The single writer thread: batches samples and requests and inserts them every ~0.5 s."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import sqlalchemy as sa

from storage.db import Database, describe_error, display_url
from storage.models import RequestRow, Series, Source
from storage.models import Sample as SampleRow
from storage.records import RequestRecord, Sample

log = logging.getLogger(__name__)
MAX_BATCHES_PER_ROUND = 40


def _insert_ignoring_duplicates(db: Database, table: sa.Table) -> sa.Insert:
    # A source may resend a timestamp (e.g. two scrapes within a millisecond); keep the first.
    name = db.engine.dialect.name
    if name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        return sa.insert(table)
    return insert(table).on_conflict_do_nothing()


class SeriesIds:
    """Maps series keys ("source/metric") to ids, creating sources and series on first sight."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._ids: dict[str, int] = {}

    def resolve(self, conn: sa.Connection, keys: Iterable[str]) -> dict[str, int]:
        missing = sorted({k for k in keys if k not in self._ids})
        if missing:
            self._load(conn, missing)
        return self._ids

    def _load(self, conn: sa.Connection, keys: list[str]) -> None:
        sources = {k.split("/", 1)[0] for k in keys}
        source_ids = ensure_sources(conn, sources)
        rows = [{"key": k, "name": k.split("/", 1)[-1],
                 "source_id": source_ids[k.split("/", 1)[0]]} for k in keys]
        ins = _insert_ignoring_duplicates(self._db, Series.__table__)
        conn.execute(ins, rows)
        found = conn.execute(sa.select(Series.key, Series.id).where(Series.key.in_(keys)))
        self._ids.update(dict(found.all()))


def ensure_sources(conn: sa.Connection, names: Iterable[str]) -> dict[str, int]:
    """Ids of the named sources, inserting the ones not yet stored."""
    names = sorted(set(names))
    have = dict(conn.execute(sa.select(Source.name, Source.id).where(Source.name.in_(names))).all())
    new = [{"name": n, "kind": "unknown", "created_ms": int(time.time() * 1000)}
           for n in names if n not in have]
    if new:
        conn.execute(sa.insert(Source.__table__), new)
        have = dict(conn.execute(
            sa.select(Source.name, Source.id).where(Source.name.in_(names))).all())
    return have


def describe_sources(conn: sa.Connection, described: dict[str, dict]) -> None:
    """Set the kind, version and URL of the named sources (a None field is left as it is)."""
    ids = ensure_sources(conn, described)
    t = Source.__table__
    stored = dict(conn.execute(sa.select(t.c.id, t.c.kind).where(t.c.id.in_(ids.values()))).all())
    for name, fields in described.items():
        values = {k: v for k, v in fields.items() if v is not None}
        kind = values.get("kind")
        if kind and (stored.get(ids[name]) or "").startswith(kind + " "):
            del values["kind"]  # the stored kind says more (the Servers pane's "KIND job=NAME")
        if values:
            conn.execute(sa.update(Source.__table__).where(Source.id == ids[name])
                         .values(**values))


def request_row(record: RequestRecord, source_id: int) -> dict:
    """The requests-table row of one record (seconds become milliseconds)."""
    ms = lambda s: None if s is None else s * 1000.0  # noqa: E731
    return {"source_id": source_id, "run_id": record.run_id, "ts_ms": int(record.ts * 1000),
            "ttft_ms": ms(record.ttft_s), "tpot_ms": ms(record.tpot_s), "e2e_ms": ms(record.e2e_s),
            "itl_ms": [x * 1000.0 for x in record.itl_s] or None,
            "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
            "ok": record.ok, "error": record.error}


class Writer:
    """Owns all inserts: callers submit from any thread; one thread writes in batches.

    Nothing is lost without being counted: `dropped` counts the samples (and `dropped_requests`
    the request records) discarded because the queue was full while the database could not be
    written, or still unwritten when close() gave up; at every moment
    `submitted_samples == written_samples + dropped + pending samples`. A failed batch is rolled
    back whole, so what was stored before stays intact, and is retried on the next round."""

    def __init__(self, db: Database, *, interval_s: float = 0.5, max_pending: int = 2_000_000,
                 batch_rows: int = 50_000,
                 on_flush: Callable[[float], None] | None = None,
                 on_error: Callable[[str], None] | None = None,
                 on_recover: Callable[[str], None] | None = None,
                 maintenance: Callable[[Database], None] | None = None,
                 maintenance_every_s: float = 60.0) -> None:
        self.db = db
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.batch_rows = batch_rows
        self.on_flush = on_flush
        self.on_error = on_error
        self.on_recover = on_recover  # told, once, when writes succeed again after an error
        self.maintenance = maintenance
        self.maintenance_every_s = maintenance_every_s
        self.last_error: str | None = None
        self.submitted_samples = 0
        self.written_samples = 0
        self.written_requests = 0
        self.dropped = 0
        self.dropped_requests = 0
        self._samples: deque[Sample] = deque()
        self._requests: deque[RequestRecord] = deque()
        self._described: dict[str, dict] = {}  # source name -> kind/version/url to store
        self._inflight = (0, 0)  # (samples, requests) taken by the batch being written
        # Write attempts so far, and the number of the last that failed: close() stops waiting
        # once an attempt begun after it was called has failed.
        self._attempts = 0
        self._last_failed = 0
        self._closing_after: int | None = None  # the attempt count when close() was called
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._stop = False
        self._closed = False
        self._series = SeriesIds(db)
        self._thread: threading.Thread | None = None
        self._last_maintenance = time.monotonic()

    def start(self) -> Writer:
        self._thread = threading.Thread(target=self._run, name="servescope-writer", daemon=True)
        self._thread.start()
        return self

    def submit(self, samples: Iterable[Sample] = (),
               requests: Iterable[RequestRecord] = ()) -> None:
        """Queue records for the next batch; never blocks on the database."""
        samples, requests = list(samples), list(requests)
        with self._lock:
            self.submitted_samples += len(samples)
            if self._closed:  # nothing will write them any more: say so in the count
                self.dropped += len(samples)
                self.dropped_requests += len(requests)
                return
            self._samples.extend(samples)
            self._requests.extend(requests)
            # Memory stays bounded while the database is unwritable; the oldest unsaved go first.
            while len(self._samples) > self.max_pending:
                self._samples.popleft()
                self.dropped += 1
            while len(self._requests) > self.max_pending:
                self._requests.popleft()
                self.dropped_requests += 1

    def describe_source(self, name: str, kind: str, version: str | None = None,
                        url: str | None = None) -> None:
        """Store what a source turned out to be (its detected kind, the version it names, its
        URL) with its row, creating the row if needed; written with the next batch."""
        with self._lock:
            if self._closed:
                return
            self._described[name] = {"kind": kind, "version": version, "url": url}
        self._wake.set()

    @property
    def pending(self) -> int:
        with self._lock:
            return (len(self._samples) + len(self._requests)
                    + self._inflight[0] + self._inflight[1])

    def stats(self) -> dict[str, int | str | None]:
        """Counts for a status line or a summary: written, dropped, pending, the last error."""
        with self._lock:
            pending = len(self._samples) + self._inflight[0]
        return {"submitted": self.submitted_samples, "written": self.written_samples,
                "written_requests": self.written_requests, "dropped": self.dropped,
                "dropped_requests": self.dropped_requests, "pending": pending,
                "last_error": self.last_error}

    def flush(self, timeout: float = 10.0, *, until_failure: bool = False) -> bool:
        """Wait until everything submitted so far is written; False if it could not be (in
        `timeout`, or with `until_failure` as soon as a write fails)."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        with self._lock:
            begun = self._attempts  # attempts under way do not count: they may predate a fix
            while self._samples or self._requests or self._described or any(self._inflight):
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                if until_failure and self._last_failed > begun:
                    return False
                self._idle.wait(min(left, 0.05))
                self._wake.set()
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Write what is pending and stop the thread; False if something stayed unwritten,
        which is then counted in `dropped` (the process is about to let it go). One failed
        attempt ends the wait: a full disk does not empty itself in the seconds left, and a
        locked database has had its busy timeout inside that attempt."""
        with self._lock:
            self._closing_after = self._attempts
        done = self.flush(timeout, until_failure=True)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            self._closed = True
            # A batch still being written when the join gave up is counted as dropped too; if
            # it commits after all, write_pending takes it back out of the count.
            self.dropped += len(self._samples) + self._inflight[0]
            self.dropped_requests += len(self._requests) + self._inflight[1]
            self._samples.clear()
            self._requests.clear()
        return done

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.write_pending()
            self._maybe_maintain()

    def write_pending(self) -> None:
        """Insert what is queued, in transactions of at most `batch_rows` rows (a full disk
        then keeps what fitted); on a failure keep the rest queued and report. A round ends after
        MAX_BATCHES_PER_ROUND batches so maintenance still runs under a steady backlog."""
        for _ in range(MAX_BATCHES_PER_ROUND):
            batch = self._take_batch()
            if batch is None:
                return
            if not self._write_batch(*batch):
                return

    def _take_batch(self) -> tuple[list[Sample], list[RequestRecord], int, dict] | None:
        with self._lock:
            if self._closed or not (self._samples or self._requests or self._described):
                return None
            if self._closing_after is not None and self._last_failed > self._closing_after:
                return None  # closing, and the last try failed: another would only wait again
            n = min(len(self._samples), self.batch_rows)
            samples = [self._samples.popleft() for _ in range(n)]
            m = min(len(self._requests), self.batch_rows)
            requests = [self._requests.popleft() for _ in range(m)]
            described, self._described = self._described, {}
            self._inflight = (n, m)
            self._attempts += 1
            attempt = self._attempts
        return samples, requests, attempt, described

    def _write_batch(self, samples: list[Sample], requests: list[RequestRecord],
                     attempt: int, described: dict | None = None) -> bool:
        try:
            self._insert(samples, requests, described or {})
        except Exception as exc:  # any driver error: keep the batch, say why once
            with self._lock:
                self._inflight = (0, 0)
                self._last_failed = attempt
                if self._closed:  # close() counted it already
                    return False
                self._samples.extendleft(reversed(samples))
                self._requests.extendleft(reversed(requests))
                self._described = {**(described or {}), **self._described}
            self._report(describe_error(exc, self.db.engine.url))
            return False
        with self._lock:
            self._inflight = (0, 0)
            if self._closed:  # close() gave up on it and counted it dropped; it made it after all
                self.dropped -= len(samples)
                self.dropped_requests -= len(requests)
            self.written_samples += len(samples)
            self.written_requests += len(requests)
            self._idle.notify_all()
        if self.last_error is not None and self.on_recover is not None:
            self.on_recover(f"The database {display_url(self.db.engine.url)} accepts writes "
                            "again; the samples held meanwhile are being stored.")
        self.last_error = None
        if self.on_flush is not None and samples:
            self.on_flush(max(s.ts for s in samples))
        return True
    def _insert(self, samples: list[Sample], requests: list[RequestRecord],
                described: dict[str, dict] | None = None) -> None:
        with self.db.engine.begin() as conn:
            if described:
                describe_sources(conn, described)
            if samples:
                ids = self._series.resolve(conn, {s.series for s in samples})
                rows = [{"series_id": ids[s.series], "ts_ms": int(s.ts * 1000),
                         "value": float(s.value)} for s in samples]
                conn.execute(_insert_ignoring_duplicates(self.db, SampleRow.__table__), rows)
            if requests:
                sources = ensure_sources(conn, {r.source for r in requests})
                conn.execute(sa.insert(RequestRow.__table__),
                             [request_row(r, sources[r.source]) for r in requests])

    def _report(self, message: str) -> None:
        if message != self.last_error:
            log.warning("%s", message)
            if self.on_error is not None:
                self.on_error(message)
        self.last_error = message

    def _maybe_maintain(self) -> None:
        if self.maintenance is None:
            return
        if time.monotonic() - self._last_maintenance < self.maintenance_every_s:
            return
        self._last_maintenance = time.monotonic()
        try:
            self.maintenance(self.db)
        except Exception as exc:  # rollups can wait for the next round; data is already stored
            self._report(describe_error(exc, self.db.engine.url))
