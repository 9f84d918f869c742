"""The Monitor, Servers and History panes, sharing one MonitorService (hub, writer, database)."""
