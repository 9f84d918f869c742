"""The monitor's engine room (no Qt): database, writer, hub, sources, SLO alerts, saved servers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from app.panes.monitor.state import (
    API_PROMETHEUS,
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    LIVE_ONLY_S,
    ServerEntry,
    canary_source_name,
)
from monitor.alerts import AlertEvent, slo_rules
from monitor.canary import canary_rule
from monitor.drift import drift_rules
from monitor.types import SourceStatus

log = logging.getLogger(__name__)
# The SLO is judged on the servers' own windowed p99; a few seconds of it must stay above.
ALERT_WINDOW_S = 5.0


class _EngineStats:
    """Gives EngineSource the `last_stats` it reads, from the Engine pane's host."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    @property
    def last_stats(self) -> Any:
        return self._stats()


class MonitorService:
    """One recording (monitor.recording: hub, writer, SLO alerts, as `servescope record` runs)
    and one database shared by the Monitor, Servers and History panes, plus the saved servers."""

    def __init__(self, on_error: Callable[[str], None] | None = None,
                 engine_stats: Callable[[], Any] | None = None, gpus: bool = True,
                 engine_finished: Any = None, db_url: str | None = None,
                 on_database: Callable[[], None] | None = None,
                 engine_canaries: Any = None,
                 engine_spec: Callable[[], Any] | None = None) -> None:
        self.on_error = on_error
        self.on_database = on_database  # called (on the opener thread) once open or failed
        self.db_url = db_url  # None: the default SQLite file in the user's data folder
        self.db: Any = None
        self.db_error: str | None = None
        self.db_opening = False
        self._opener: threading.Thread | None = None
        self.recording: Any = None
        self.gpu_message = ""
        self.servers: dict[str, ServerEntry] = {}
        self.server_errors: dict[str, str] = {}
        self.slo_ms = {"ttft": DEFAULT_SLO_TTFT_MS, "tpot": DEFAULT_SLO_TPOT_MS}
        self._engine_stats = engine_stats
        self._engine_finished = engine_finished  # the host's FinishedListeners: add / remove
        self._engine_canaries = engine_canaries  # the host's canary listeners, the same kind
        self._engine_spec = engine_spec  # the host's speculative-decoding counters, or None
        self.engine_source: Any = None
        self._gpus = gpus
        self._lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._users = 0

    @property
    def hub(self) -> Any:
        """The recording's hub (None before `start()`): live series and source statuses."""
        return None if self.recording is None else self.recording.hub

    @property
    def writer(self) -> Any:
        """The recording's writer (None until the database is open)."""
        return None if self.recording is None else self.recording.writer

    def acquire(self) -> None:
        """A pane uses the service; it shuts down when the last user releases it."""
        self._users += 1

    def release(self) -> None:
        """A pane is done (window closing); the last one stops the hub and closes the database."""
        self._users -= 1
        if self._users <= 0:
            self.shutdown()

    # ---- lifecycle
    def start(self) -> None:
        """Start the hub now and open the database on a worker thread (migrations can take a
        while, and a locked file waits out the busy timeout); a failure leaves charts working."""
        if self._started:
            return
        self._started = True
        from monitor.recording import Recording

        # The database is attached once it opens; until then the charts are live only.
        self.recording = Recording(on_error=self._error)
        if self._gpus:
            self._add_gpus()
        if self._engine_stats is not None:
            from monitor.engine_source import EngineSource

            self.engine_source = EngineSource(_EngineStats(self._engine_stats),
                                              spec_summary=self._engine_spec)
            self.hub.add_source(self.engine_source)
            if self._engine_finished is not None:
                self._engine_finished.add(self.engine_source.add_finished)
            if self._engine_canaries is not None:
                self._engine_canaries.add(self._on_engine_canary)
        self._rebuild_rules()
        self.recording.start()
        self.db_opening = True
        self._opener = threading.Thread(target=self._open_database, name="servescope-db-open",
                                        daemon=True)
        self._opener.start()

    def _open_database(self) -> None:
        """On the opener thread: open and migrate, then attach the writer and saved servers."""
        from storage.db import StorageError, default_url, display_url, open_database

        try:
            db = open_database(self.db_url)
            entries = self._load_servers(db)
        except StorageError as exc:
            self._database_failed(str(exc))
            return
        except Exception as exc:  # a driver's own error type: still one sentence, app running
            where = display_url(self.db_url or default_url())
            self._database_failed(f"The database {where} could not be opened: "
                                  f"{str(exc).rstrip('.')}.")
            return
        self._database_opened(db, entries)

    def _database_failed(self, message: str) -> None:
        with self._lock:
            self.db_error = f"{message} Live charts keep working; nothing is being recorded."
            self.db_opening = False
        self._error(self.db_error)
        self._announce_database()

    def _database_opened(self, db: Any, entries: list[ServerEntry]) -> None:
        with self._lock:
            if self._stopped:  # the window closed while the database was opening
                db.close()
                return
            self.db = db
            self.recording.attach_database(db)
            self.db_opening = False
        # list() first: the GUI thread may add a server while this thread reads the dict.
        added_meanwhile = [e for e in list(self.servers.values()) if e.name not in
                           {x.name for x in entries}]
        for entry in entries:
            if entry.name not in self.servers:
                self._attach(entry)
        for entry in added_meanwhile:
            self._save_server(entry)
        self._rebuild_rules()
        self._announce_database()

    def _announce_database(self) -> None:
        if self.on_database is not None:
            self.on_database()

    def wait_for_database(self, timeout: float | None = None) -> bool:
        """Block until the database is open or has failed (for the command line and tests);
        False before start(), when it has not begun to open."""
        if self._opener is not None:
            self._opener.join(timeout)
        return self._started and not self.db_opening

    def _add_gpus(self) -> None:
        from monitor.nvml import NvmlSource

        source = NvmlSource()
        if source.status.state == "unavailable":
            self.gpu_message = "no NVIDIA driver: 0 local GPUs"
        else:
            self.gpu_message = source.status.message
        self.hub.add_source(source)

    def shutdown(self) -> None:
        """Stop the hub, write what is pending, close the database."""
        if self._opener is not None:
            self._opener.join(10)  # an open in progress finishes (or times out) first
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = True
                return
            self._stopped = True
        if self._engine_finished is not None and self.engine_source is not None:
            self._engine_finished.remove(self.engine_source.add_finished)
        if self._engine_canaries is not None:
            self._engine_canaries.remove(self._on_engine_canary)
        if not self.recording.stop():
            log.warning("unsaved samples at shutdown: %s", self.writer.last_error)
        self.recording.close()

    def _error(self, message: str) -> None:
        if self.on_error is not None:
            self.on_error(message)

    # ---- servers
    def add_server(self, entry: ServerEntry, replacing: str | None = None) -> None:
        """Save ``entry`` (replacing the server named ``replacing``) and start watching it."""
        if entry.name in self.servers and entry.name != replacing:
            raise ValueError(f"a server named {entry.name!r} already exists")
        if replacing is not None:
            self.remove_server(replacing)
        self._save_server(entry)
        self._attach(entry)
        self._rebuild_rules()

    def remove_server(self, name: str) -> None:
        """Stop watching ``name`` and forget its settings; its recorded data stays."""
        self.servers.pop(name, None)
        self.server_errors.pop(name, None)
        if self.hub is not None:
            self.hub.remove_source(name)
            self.hub.remove_source(f"{name}-cost")
            self.hub.remove_source(canary_source_name(name))
        self._save_server(None, forget=name)
        self._rebuild_rules()

    def _on_engine_canary(self, scores: list) -> None:
        """The Engine pane's canary scores (on the engine thread) go to the engine source."""
        if self.engine_source is not None:
            for model, score in scores:
                self.engine_source.add_canary(model, score)

    def score_canary_now(self, name: str) -> str | None:
        """Score ``name``'s quality canary now rather than at its next slot; a sentence saying
        why it cannot be (no canary set, the monitor not running), else None."""
        entry = self.servers.get(name)
        if entry is None or entry.canary_every_s is None:
            return (f"{name} has no quality canary: set one in Edit server (Quality canary "
                    "every … minutes), then score it.")
        if self.hub is None or not self.hub.scrape_now(canary_source_name(name)):
            why = self.server_errors.get(name, "the monitor is not started")
            return f"{name}'s canary is not running: {why.rstrip('.')}."
        return None

    def _attach(self, entry: ServerEntry) -> None:
        from monitor.cost import CostSource

        self.servers[entry.name] = entry
        if self.hub is None:
            return
        try:
            config = server_config(entry)
        except ValueError as exc:
            self.server_errors[entry.name] = str(exc)
            return
        self.server_errors.pop(entry.name, None)
        self.hub.add_source(make_source(entry, config, backfill_s=LIVE_ONLY_S,
                                        baselines=self._drift_baselines(entry)))
        if entry.dollars_per_hour is not None:
            self.hub.add_source(CostSource(self.hub, entry.name, entry.dollars_per_hour))
        if entry.canary_every_s is not None:
            self.hub.add_source(canary_source(entry, config, self._canary_scores(entry)))

    def _canary_scores(self, entry: ServerEntry) -> list[float]:
        """The canary's first stored perplexities: its baseline outlives the session (a drift
        across a restart, say a server upgraded overnight, is a drift), or none."""
        import sqlalchemy as sa

        from monitor.canary import DEFAULT_BASELINE_SCORES
        from storage.queries import first_values

        if self.db is None:
            return []
        try:
            return first_values(self.db, f"{entry.canary_name}/canary_perplexity",
                                DEFAULT_BASELINE_SCORES)
        except sa.exc.SQLAlchemyError as exc:  # a locked database: learn the baseline again
            self._db_failed(exc)
            return []

    def _drift_baselines(self, entry: ServerEntry) -> dict[str, dict]:
        """The response-length and finish-reason baselines an earlier session stored for this
        server (as `<name>/<drift>_baseline[<category>]` series), or none: learn them again."""
        import sqlalchemy as sa

        from monitor.drift import load_baselines

        if self.db is None:
            return {}
        try:
            return load_baselines(self.db, entry.name)
        except sa.exc.SQLAlchemyError as exc:
            self._db_failed(exc)
            return {}

    def statuses(self) -> dict[str, SourceStatus]:
        """Every source's status; a server whose token cannot be resolved is down with why."""
        out = self.hub.statuses() if self.hub is not None else {}
        for name, error in self.server_errors.items():
            out[name] = SourceStatus(state="down", last_error=error)
        return out

    # ---- persistence: servers live in the database's sources table (url set = user-added)
    def _load_servers(self, db: Any) -> list[ServerEntry]:
        import sqlalchemy as sa  # here, not at import: it costs start-up time

        from storage.db import StorageError, describe_error
        from storage.models import Source

        try:
            with db.engine.connect() as conn:
                rows = conn.execute(sa.select(Source.name, Source.url, Source.token_ref,
                                              Source.dollars_per_hour, Source.kind,
                                              Source.canary_every_s,
                                              Source.canary_decode_from)
                                    .where(Source.url.is_not(None))).all()
        except sa.exc.SQLAlchemyError as exc:
            db.close()
            raise StorageError(describe_error(exc, db.engine.url)) from exc
        entries = []
        for name, url, token_ref, price, kind, canary_every_s, decode_from in rows:
            try:
                entries.append(ServerEntry.from_stored(name, url, token_ref, price, kind,
                                                       canary_every_s, decode_from))
            except ValueError as exc:
                self._error(f"The saved server {name!r} is invalid and was skipped: {exc}")
        return entries

    def _save_server(self, entry: ServerEntry | None, forget: str | None = None) -> None:
        import sqlalchemy as sa  # here, not at import: it costs start-up time
        if self.db is None:
            return
        from storage.models import Source
        from storage.writer import ensure_sources

        try:
            with self.db.engine.begin() as conn:
                if forget is not None:
                    conn.execute(sa.update(Source.__table__).where(Source.name == forget)
                                 .values(url=None, token_ref=None, dollars_per_hour=None,
                                         kind="unknown", canary_every_s=None,
                                         canary_decode_from=None))
                if entry is not None:
                    ensure_sources(conn, [entry.name])
                    conn.execute(sa.update(Source.__table__).where(Source.name == entry.name)
                                 .values(url=entry.url, token_ref=entry.token_ref or None,
                                         dollars_per_hour=entry.dollars_per_hour,
                                         kind=entry.stored_kind,
                                         canary_every_s=entry.canary_every_s,
                                         canary_decode_from=entry.canary_decode_from))
        except sa.exc.SQLAlchemyError as exc:
            self._db_failed(exc)

    def _db_failed(self, exc: Exception) -> None:
        from storage.db import describe_error

        self._error(describe_error(exc, self.db.engine.url))

    # ---- SLO alerts
    def set_slo(self, ttft_ms: float, tpot_ms: float) -> None:
        """Change the p99 TTFT / TPOT objectives the charts draw and the alerts check."""
        self.slo_ms = {"ttft": float(ttft_ms), "tpot": float(tpot_ms)}
        self._rebuild_rules()

    def _rebuild_rules(self) -> None:
        if self.recording is not None:
            # list(): the database thread may attach a saved server meanwhile.
            canaries = [canary_rule(e.canary_name, interval_s=e.canary_every_s)
                        for e in list(self.servers.values()) if e.canary_every_s is not None]
            self.recording.set_rules(slo_rules(self.servers, self.slo_ms, ALERT_WINDOW_S)
                                     + drift_rules(list(self.servers)) + canaries)

    def firing(self) -> list[AlertEvent]:
        """The latest event of each rule now firing, for the alert banner."""
        return [] if self.recording is None else self.recording.firing()


def server_config(entry: ServerEntry, interval_s: float = 1.0) -> Any:
    """The ServerConfig of an entry, its token resolved from the environment now."""
    from monitor.remote import ServerConfig, resolve_token

    return ServerConfig(entry.name, entry.url, token=resolve_token(entry.token_ref or None),
                        interval_s=interval_s, dollars_per_hour=entry.dollars_per_hour)


def canary_source(entry: ServerEntry, config: Any, stored: list[float] = ()) -> Any:
    """The quality canary of ``entry``: the held-out text scored on it every
    ``canary_every_s`` seconds, its baseline the median of its first scores (``stored``: those
    an earlier session recorded)."""
    from monitor.canary import CanaryBaseline, CanarySource

    return CanarySource(entry.canary_name, entry.url, api_key=config.token,
                        interval_s=entry.canary_every_s, decode_from=entry.canary_decode_from,
                        baseline=CanaryBaseline(seen=list(stored)))


def make_source(entry: ServerEntry, config: Any, backfill_s: float = 0.0,
                baselines: dict | None = None) -> Any:
    """The source reading ``entry``: its /metrics (its output drift judged against
    ``baselines``, else against its first requests), or a Prometheus server's API (the first
    poll of which backfills ``backfill_s`` seconds so the charts do not start empty), through
    SSH when its URL is ssh://."""
    from monitor.drift import OutputDrift
    from monitor.remote import PrometheusSource
    from monitor.ssh import server_source

    if entry.api == API_PROMETHEUS:
        from monitor.promapi import PromApiSource, default_queries

        queries = default_queries(entry.job)
        return server_source(config, lambda c: PromApiSource(c, queries, backfill_s=backfill_s))
    # An ssh:// entry is read through an SSH tunnel, with its box's GPUs (monitor.ssh).
    return server_source(config, lambda c: PrometheusSource(
        c, drift=OutputDrift(baselines=baselines)))


def test_connection(entry: ServerEntry) -> SourceStatus:
    """One scrape of ``entry`` with a fresh client (not the hub's), reporting kind and status."""
    try:
        config = server_config(entry)
    except ValueError as exc:
        return SourceStatus(state="down", last_error=str(exc))
    source = make_source(entry, config)
    try:
        return source.test_connection()
    finally:
        source.close()

