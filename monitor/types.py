"""What every source produces: samples, request records, and an up / down / last-error status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from storage.records import RequestRecord, Sample

__all__ = ["REASONS", "Poll", "RequestRecord", "Sample", "Source", "SourceStatus"]

# Why a source is down, as a short code kept beside the sentence in `last_error`: the sentence is
# what a user reads, the code is what a pane or a script can key an icon or a filter on.
REASONS = {
    "timeout": "the scrape did not finish within its deadline",
    "too_large": "the body was over the size cap",
    "not_prometheus": "the body is not Prometheus text",
    "invalid_utf8": "the body is not valid UTF-8",
    "http_status": "the server answered an HTTP error status",
    "refused": "the connection was refused",
    "connect": "the server could not be reached",
    "tls": "the TLS certificate could not be verified",
    "non_finite": "every value was NaN or ±Inf",
    "error": "another failure (see the sentence)",
}


@dataclass
class Poll:
    """What one poll of a source returned."""

    samples: list[Sample] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)


@dataclass
class SourceStatus:
    """A source's health as the Servers pane shows it.

    `reason` (a key of REASONS) and `last_error` (one sentence) say why a source is down;
    `since` is when `state` last changed. The scrape counters count real attempts (a poll inside
    a back-off is not one); `non_finite` is how many NaN/±Inf values the last scrape carried
    (skipped: SQLite cannot store them), `non_finite_total` over the whole run."""

    state: str = "unknown"  # "up", "down", "unknown", "unavailable"
    kind: str = "unknown"
    version: str | None = None  # what the server says it runs, where it says (vLLM: /version)
    api_only: bool = False  # no Prometheus text: read through its OpenAI API's /v1/models
    last_error: str | None = None
    last_ok: float | None = None
    message: str = ""
    reason: str | None = None
    since: float | None = None
    scrapes: int = 0
    failed_scrapes: int = 0
    non_finite: int = 0
    non_finite_total: int = 0


class Source(Protocol):
    """Anything the hub can poll: a name, a polling interval and a poll method."""

    name: str
    interval_s: float
    status: SourceStatus

    def poll(self, now: float) -> Poll: ...

    def close(self) -> None: ...
