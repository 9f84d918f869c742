"""Builds the three monitor panes around one shared MonitorService, ready for register_pane."""

from __future__ import annotations

from typing import Any

from app.panes.monitor.history import HistoryPane
from app.panes.monitor.pane import MonitorPane, ServiceBridge
from app.panes.monitor.servers import ServersPane
from app.panes.monitor.service import MonitorService


def monitor_panes(host: Any = None, gpus: bool = True, settings: Any = None) -> list[Any]:
    """The Monitor, Servers and History panes; ``host`` (an EngineHost) adds the engine source;
    ``settings`` (the app's Settings) keeps the Monitor pane's window and SLOs."""
    bridge = ServiceBridge()
    service = MonitorService(on_error=bridge.error.emit,
                             engine_stats=None if host is None else host.stats, gpus=gpus,
                             engine_finished=None if host is None else host.finished,
                             on_database=bridge.database.emit,
                             engine_canaries=None if host is None else host.canaries,
                             engine_spec=None if host is None else host.spec_summary)
    monitor = MonitorPane(service, bridge, settings)
    bridge.setParent(monitor)  # the bridge lives as long as the pane that shows its errors
    servers = ServersPane(service)
    history = HistoryPane(service)
    servers.run_stored.connect(lambda _run_id: history.reload())
    if host is not None:  # engine benchmarks are runs too, listed beside the load tests
        host.bench_finished.connect(history.add_benchmark)
    # The database opens on a worker thread; each pane catches up when it is ready (or failed).
    bridge.database.connect(servers.refresh)
    bridge.database.connect(history.reload)
    return [monitor, servers, history]
