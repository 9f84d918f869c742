"""What every source produces: samples, request records, and an up / down / last-error status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from storage.records import RequestRecord, Sample

__all__ = ["Poll", "RequestRecord", "Sample", "Source", "SourceStatus"]


@dataclass
class Poll:
    """What one poll of a source returned."""

    samples: list[Sample] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)


@dataclass
class SourceStatus:
    """A source's health as the Servers pane shows it."""

    state: str = "unknown"  # "up", "down", "unknown", "unavailable"
    kind: str = "unknown"
    last_error: str | None = None
    last_ok: float | None = None
    message: str = ""


class Source(Protocol):
    """Anything the hub can poll: a name, a polling interval and a poll method."""

    name: str
    interval_s: float
    status: SourceStatus

    def poll(self, now: float) -> Poll: ...

    def close(self) -> None: ...
