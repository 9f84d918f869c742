"""The hub: scrapes each source on its own thread, keeps ring buffers, feeds the storage writer."""

from __future__ import annotations

import dataclasses
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


def next_slot(previous: float, interval_s: float, now: float) -> float:
    """The first slot of `previous` + k * `interval_s` after `now`: a scrape that overran its
    interval skips the slots it missed instead of bunching up behind them (as Prometheus'
    ticker does)."""
    missed = max(0, int((now - previous) // interval_s))
    return previous + (missed + 1) * interval_s


def status_key(status: SourceStatus) -> tuple:
    """What a status-change listener hears about: the state, why, and NaN/±Inf appearing."""
    return status.state, status.reason, status.non_finite > 0


class ScrapeLoop:
    """One source's own thread and schedule, as Prometheus runs one scrape loop per target: a
    slow or hanging source delays only itself. The loop closes its source when it ends, so a
    scrape in flight never has its client closed under it."""

    def __init__(self, hub: Hub, source: Source) -> None:
        self.hub = hub
        self.source = source
        self.stopping = threading.Event()
        # Set to end the wait for the next slot early: by stop() and by a scrape asked for now
        # (the scrape then runs on this loop's own thread, never beside one in flight).
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"servescope-scrape-{source.name}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def _run(self) -> None:
        interval = max(self.source.interval_s, self.hub.tick_s)  # 0 would spin
        try:
            slot = time.monotonic()
            while not self.stopping.is_set():
                self.hub.scrape(self.source, time.time())
                slot = next_slot(slot, interval, time.monotonic())
                if self.wake.wait(max(0.0, slot - time.monotonic())):
                    self.wake.clear()
                    slot = time.monotonic()  # asked for now: the schedule restarts from here
        finally:
            self.source.close()


class Hub:
    """Scrapes each source on its own thread and schedule; one failing, slow or hanging source
    never stops or delays the others. A thread of its own runs `on_tick` every `tick_s`.

    `tick()` polls every due source inline instead, for callers that drive a hub that was not
    started (tests, scripts). `statuses()` gives a copy of every source's status (state, reason,
    last_error, counters); `on_status(name, status)` is called, from the source's thread, when a
    source's state or reason changes, or NaN/±Inf values start or stop arriving."""

    def __init__(self, sources: Iterable[Source] = (), writer: Writer | None = None, *,
                 capacity: int = 36_000, tick_s: float = 0.05,
                 on_tick: Callable[[Hub, float], None] | None = None,
                 on_status: Callable[[str, SourceStatus], None] | None = None,
                 stop_wait_s: float = 2.0) -> None:
        self.writer = writer
        self.capacity = capacity
        self.tick_s = tick_s
        self.on_tick = on_tick
        self.on_status = on_status
        self.stop_wait_s = stop_wait_s
        self.tick_error: str | None = None  # the last on_tick failure, for a status line
        self.requests: list[RequestRecord] = []
        self._sources: dict[str, Source] = {}
        self._loops: dict[str, ScrapeLoop] = {}
        self._due: dict[str, float] = {}
        self._reported: dict[str, tuple] = {}
        self._described: dict[str, tuple] = {}
        self._rings: dict[str, RingBuffer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._closed = False  # after stop(): a scrape that ends late stores nothing
        for source in sources:
            self.add_source(source)

    def add_source(self, source: Source) -> None:
        with self._lock:
            if source.name in self._sources:
                raise ValueError(f"a source named {source.name!r} is already attached")
            self._sources[source.name] = source
            self._due[source.name] = 0.0
            loop = None
            if self._started:
                loop = self._loops[source.name] = ScrapeLoop(self, source)
        if loop is not None:
            loop.start()

    def remove_source(self, name: str) -> None:
        with self._lock:
            source = self._sources.pop(name, None)
            self._due.pop(name, None)
            self._reported.pop(name, None)
            self._described.pop(name, None)
            loop = self._loops.pop(name, None)
        if loop is not None:
            loop.stop()  # the loop closes the source once its scrape in flight ends
        elif source is not None:
            source.close()

    def scrape_now(self, name: str) -> bool:
        """Have a source scraped now, on its own loop's thread, instead of at its next slot (a
        quality canary scored on demand); False when no such source runs here. On a hub that
        was not started, the next tick() polls it."""
        with self._lock:
            if name not in self._sources:
                return False
            self._due[name] = 0.0
            loop = self._loops.get(name)
        if loop is not None:
            loop.wake.set()
        return True

    def statuses(self) -> dict[str, SourceStatus]:
        """A copy of every source's status (sources update theirs on their own threads)."""
        with self._lock:
            return {name: dataclasses.replace(s.status) for name, s in self._sources.items()}
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
        """Poll every due source once, inline (for a hub that was not started); returns how
        many samples arrived."""
        now = time.time() if now is None else now
        with self._lock:
            due = [s for name, s in self._sources.items() if self._due[name] <= now]
            for s in due:
                self._due[s.name] = now + s.interval_s
        arrived = sum(self.scrape(s, now) for s in due)
        self._on_tick_guarded(now)
        return arrived

    def scrape(self, source: Source, now: float) -> int:
        """Poll one source, keep and store what it sent, tell listeners if its status changed;
        returns how many samples arrived."""
        poll = self._poll_guarded(source, now)
        with self._lock:
            if self._closed or self._sources.get(source.name) is not source:
                return 0  # removed or stopped while it was being polled: not ours to keep
        self._store(poll.samples, poll.requests)
        self._report_status(source)
        return len(poll.samples)

    def _describe(self, source: Source) -> None:
        # The detected kind and version go to the source's stored row once, and again if they
        # change (a server upgraded in place); "unknown" is what the row starts as anyway.
        status = source.status
        identity = (status.kind, status.version)
        with self._lock:
            changed = self._described.get(source.name) != identity
            self._described[source.name] = identity
        if changed and self.writer is not None and status.kind != "unknown":
            config = getattr(source, "config", None)
            self.writer.describe_source(source.name, status.kind, status.version,
                                        getattr(config, "url", None))

    def _report_status(self, source: Source) -> None:
        self._describe(source)
        key = status_key(source.status)
        with self._lock:
            changed = self._reported.get(source.name) != key
            self._reported[source.name] = key
        if not changed or self.on_status is None:
            return
        try:
            self.on_status(source.name, dataclasses.replace(source.status))
        except Exception:  # a listener bug must not end the source's loop
            log.exception("the hub's on_status callback failed")

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
            if source.status.state != "down":
                source.status.since = now
            source.status.state, source.status.reason = "down", "error"
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
        with self._lock:
            self._started = True
            loops = [self._loops.setdefault(name, ScrapeLoop(self, source))
                     for name, source in self._sources.items()]
        for loop in loops:
            loop.start()
        self._thread = threading.Thread(target=self._run, name="servescope-hub", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._on_tick_guarded(time.time())
            self._stop.wait(max(0.0, self.tick_s - (time.monotonic() - started)))

    def stop(self) -> None:
        """Stop every loop; wait at most `stop_wait_s` for scrapes in flight (a hanging source
        must not hold up the exit), after which a late one stores nothing."""
        self._stop.set()
        with self._lock:
            loops = list(self._loops.values())
            unstarted = [s for name, s in self._sources.items() if name not in self._loops]
        for loop in loops:
            loop.stop()
        if self._thread is not None:
            self._thread.join(10)
        deadline = time.monotonic() + self.stop_wait_s
        for loop in loops:
            loop.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._closed = True
        for source in unstarted:
            source.close()
