"""The hub: polls sources on a background thread, keeps ring buffers, feeds the storage writer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from monitor.types import Poll, RequestRecord, Sample, Source, SourceStatus
from storage.writer import Writer

log = logging.getLogger(__name__)


class RingBuffer:
    """The newest `capacity` (timestamp, value) pairs of one series, in preallocated arrays."""

    def __init__(self, capacity: int) -> None:
        self.ts = np.zeros(capacity)
        self.values = np.zeros(capacity)
        self.count = 0  # total ever appended; the write position is count % capacity

    def append(self, ts: float, value: float) -> None:
        i = self.count % len(self.ts)
        self.ts[i], self.values[i] = ts, value
        self.count += 1

    def view(self, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the held points in time order, optionally only those at or after `since`."""
        cap = len(self.ts)
        if self.count <= cap:
            ts, values = self.ts[: self.count].copy(), self.values[: self.count].copy()
        else:
            i = self.count % cap
            ts = np.concatenate((self.ts[i:], self.ts[:i]))
            values = np.concatenate((self.values[i:], self.values[:i]))
        if since is not None:
            keep = ts >= since
            ts, values = ts[keep], values[keep]
        return ts, values


class Hub:
    """Polls each source when due; one failing source never stops the others."""

    def __init__(self, sources: Iterable[Source] = (), writer: Writer | None = None, *,
                 capacity: int = 36_000, tick_s: float = 0.05,
                 on_tick: Callable[[Hub, float], None] | None = None) -> None:
        self.writer = writer
        self.capacity = capacity
        self.tick_s = tick_s
        self.on_tick = on_tick
        self.tick_error: str | None = None  # the last on_tick failure, for a status line
        self.requests: list[RequestRecord] = []
        self._sources: dict[str, Source] = {}
        self._due: dict[str, float] = {}
        self._rings: dict[str, RingBuffer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for source in sources:
            self.add_source(source)

    def add_source(self, source: Source) -> None:
        with self._lock:
            if source.name in self._sources:
                raise ValueError(f"a source named {source.name!r} is already attached")
            self._sources[source.name] = source
            self._due[source.name] = 0.0

    def remove_source(self, name: str) -> None:
        with self._lock:
            source = self._sources.pop(name, None)
            self._due.pop(name, None)
        if source is not None:
            source.close()

    def statuses(self) -> dict[str, SourceStatus]:
        with self._lock:
            return {name: s.status for name, s in self._sources.items()}

    def series_keys(self) -> list[str]:
        with self._lock:
            return sorted(self._rings)

    def series(self, key: str, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The live points of one series (empty arrays if it has none yet)."""
        with self._lock:
            ring = self._rings.get(key)
            return ring.view(since) if ring else (np.empty(0), np.empty(0))

    def latest(self, key: str) -> float | None:
        ts, values = self.series(key)
        return float(values[-1]) if len(values) else None

    def tick(self, now: float | None = None) -> int:
        """Poll every due source once; returns how many samples arrived."""
        now = time.time() if now is None else now
        with self._lock:
            due = [s for name, s in self._sources.items() if self._due[name] <= now]
            for s in due:
                self._due[s.name] = now + s.interval_s
        polls = [self._poll_guarded(s, now) for s in due]
        samples = [x for p in polls for x in p.samples]
        requests = [r for p in polls for r in p.requests]
        self._store(samples, requests)
        self._on_tick_guarded(now)
        return len(samples)

    def _on_tick_guarded(self, now: float) -> None:
        if self.on_tick is None:
            return
        try:
            self.on_tick(self, now)
        except Exception as exc:  # a listener bug must not end the hub thread and its polling
            log.exception("the hub's on_tick callback failed")
            self.tick_error = f"{type(exc).__name__}: {exc}"

    def _poll_guarded(self, source: Source, now: float) -> Poll:
        try:
            poll = source.poll(now)
        except Exception as exc:  # a source bug must not stop the other sources
            log.exception("source %s failed", source.name)
            source.status.state = "down"
            source.status.last_error = f"{type(exc).__name__}: {exc}"
            return Poll()
        prefix = source.name + "/"
        # A source may only write its own series; anything else is dropped, not mixed in.
        poll.samples = [s for s in poll.samples if s.series.startswith(prefix)]
        return poll

    def _store(self, samples: list[Sample], requests: list[RequestRecord]) -> None:
        with self._lock:
            for s in samples:
                ring = self._rings.get(s.series)
                if ring is None:
                    ring = self._rings[s.series] = RingBuffer(self.capacity)
                ring.append(s.ts, s.value)
            self.requests.extend(requests)
            del self.requests[: max(0, len(self.requests) - self.capacity)]
        if self.writer is not None and (samples or requests):
            self.writer.submit(samples, requests)

    def start(self) -> Hub:
        self._thread = threading.Thread(target=self._run, name="servescope-hub", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.tick()
            self._stop.wait(max(0.0, self.tick_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            sources = list(self._sources.values())
        for source in sources:
            source.close()
