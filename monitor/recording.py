"""One monitor assembly: a hub, the writer storing what it samples, and SLO alerts on its ticks.

`servescope record` (monitor/cli.py) and the app's Monitor service (app/panes/monitor/service.py)
both run a Recording, so the terminal and the window sample, store and alert the same way. No Qt:
callbacks come from the hub's, the writer's and the sources' threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from monitor.alerts import AlertEvaluator, AlertEvent, AlertRule
from monitor.hub import Hub
from monitor.types import Source, SourceStatus

log = logging.getLogger(__name__)


class Recording:
    """A hub whose samples a writer stores once a database is attached, with SLO alert rules
    evaluated on every hub tick and their events stored beside the samples.

    ``on_error(sentence)``: a write or an alert could not be stored; ``on_recover(sentence)``:
    writing works again; ``on_flush(ts)``: a batch was written; ``on_status(name, status)``: a
    source's state changed; ``on_alert(event)``: a rule fired or cleared (before it is stored).
    """

    def __init__(self, sources: Iterable[Source] = (), *,
                 on_error: Callable[[str], None] | None = None,
                 on_recover: Callable[[str], None] | None = None,
                 on_flush: Callable[[float], None] | None = None,
                 on_status: Callable[[str, SourceStatus], None] | None = None,
                 on_alert: Callable[[AlertEvent], None] | None = None) -> None:
        self.on_error = on_error
        self.on_alert = on_alert
        self._writer_hooks = {"on_error": on_error, "on_recover": on_recover, "on_flush": on_flush}
        self.hub = Hub(sources, on_tick=self._on_tick, on_status=on_status)
        self.db: Any = None
        self.writer: Any = None
        self._lock = threading.Lock()
        self._alerts = AlertEvaluator([])

    def attach_database(self, db: Any) -> None:
        """Store what the hub samples from now on, and the alert events, in ``db`` (an open
        storage.db.Database; `close()` closes it)."""
        from storage.rollup import Maintenance
        from storage.writer import Writer

        self.db = db
        self.writer = Writer(db, maintenance=Maintenance(), **self._writer_hooks).start()
        self.hub.writer = self.writer

    def start(self) -> Recording:
        self.hub.start()
        return self

    def stop(self) -> bool:
        """Stop sampling and write what is pending; False when samples could not be stored."""
        self.hub.stop()
        return self.writer is None or self.writer.close()

    def close(self) -> None:
        """Close the database (after `stop()`)."""
        if self.db is not None:
            self.db.close()

    # ---- SLO alerts
    def set_rules(self, rules: Iterable[AlertRule]) -> None:
        """Judge these rules from the next tick on (a rule's breach history starts afresh)."""
        evaluator = AlertEvaluator(rules, on_event=self._store_alert)
        with self._lock:
            self._alerts = evaluator

    @property
    def events(self) -> list[AlertEvent]:
        """Every fire / clear event of the current rules, oldest first."""
        with self._lock:
            return list(self._alerts.events)

    def firing(self) -> list[AlertEvent]:
        """The latest event of each rule now firing, by rule name."""
        with self._lock:
            firing = set(self._alerts.firing)
            latest = {e.rule: e for e in self._alerts.events if e.rule in firing}
        return [latest[name] for name in sorted(latest)]

    def _on_tick(self, hub: Hub, now: float) -> None:
        try:
            with self._lock:
                self._alerts.evaluate(hub, now)
        except Exception:  # a bad rule is logged here; the hub would keep only a one-line error
            log.exception("alert evaluation failed")

    def _store_alert(self, event: AlertEvent) -> None:
        if self.on_alert is not None:
            self.on_alert(event)
        if self.db is None:
            return
        import sqlalchemy as sa  # here, not at import: it costs start-up time

        from storage.db import describe_error
        from storage.queries import save_alert

        try:
            save_alert(self.db, event)
        except sa.exc.SQLAlchemyError as exc:  # a full disk or a locked file: sampling goes on
            self._error(f"The alert could not be stored: {describe_error(exc, self.db.url)}")

    def _error(self, message: str) -> None:
        if self.on_error is not None:
            self.on_error(message)
        else:
            log.warning("%s", message)
