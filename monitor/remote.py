"""Remote inference servers scraped over HTTP(S): timeouts, a size limit, back-off and a status."""

from __future__ import annotations

import abc
import os
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from monitor import ollama
from monitor.normalize import Normalizer, detect_kind
from monitor.promtext import MetricsError, parse_metrics
from monitor.types import Poll, Sample, SourceStatus

MAX_BACKOFF_S = 60.0


class FetchError(Exception):
    """A scrape that failed; the message is one sentence naming the URL."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


def resolve_token(ref: str | None) -> str | None:
    """The bearer token a stored reference points at; only "env:NAME" references exist so far."""
    if not ref:
        return None
    if ref.startswith("env:"):
        value = os.environ.get(ref[4:])
        if value is None:
            raise ValueError(f"the environment variable {ref[4:]} holding the token is not set")
        return value
    raise ValueError(f"unknown token reference {ref!r}; use env:VARIABLE")


def metrics_url(url: str) -> str:
    """The metrics endpoint of a server URL: /metrics unless the URL names a path."""
    parts = urlsplit(url)
    return url.rstrip("/") + "/metrics" if parts.path in ("", "/") else url


@dataclass
class ServerConfig:
    """How to reach one server; the token is kept in memory only, never stored."""

    name: str
    url: str
    token: str | None = field(default=None, repr=False)
    kind: str | None = None
    interval_s: float = 1.0
    timeout_s: float = 5.0
    max_bytes: int = 8 * 1024 * 1024
    dollars_per_hour: float | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{self.url!r} is not an http(s) URL; use e.g. http://host:8000")
        if not self.name or "/" in self.name:
            raise ValueError(f"server name {self.name!r} must be non-empty and without '/'")
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.max_bytes <= 0:
            raise ValueError("interval, timeout and size limit must be positive")


def backoff_delay(interval_s: float, failures: int) -> float:
    """Seconds to wait after `failures` failures in a row: doubling, at most MAX_BACKOFF_S."""
    return min(interval_s * 2 ** (failures - 1), MAX_BACKOFF_S)


def describe_error(exc: Exception, url: str, timeout_s: float) -> str:
    """One sentence for a failed HTTP request to `url`."""
    return _describe(exc, url, timeout_s)


def _describe(exc: Exception, url: str, timeout_s: float) -> str:
    text = str(exc)
    if isinstance(exc, httpx.TimeoutException):
        return f"{url} did not answer within {timeout_s:g} s"
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower():
        return f"the TLS certificate of {url} could not be verified ({text})"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url} ({text})"
    return f"{url} failed: {text or type(exc).__name__}"


class BackoffSource(abc.ABC):
    """What every polled HTTP source shares: an up/down status, exponential back-off after
    failures, a "test connection" that ignores the back-off, and closing its client."""

    def __init__(self, config: ServerConfig, kind: str) -> None:
        self.config = config
        self.name = config.name
        self.interval_s = config.interval_s
        self.status = SourceStatus(kind=config.kind or kind)
        headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        # verify=True: certificates are always checked; there is deliberately no opt-out flag.
        self.client = httpx.Client(timeout=config.timeout_s, headers=headers, verify=True)
        self.failures = 0
        self._next_try = 0.0

    @abc.abstractmethod
    def poll(self, now: float) -> Poll:
        """Read the source once; never raises (failures go to `status`)."""

    def _fail(self, now: float, message: str) -> None:
        # Exponential back-off keeps a dead server from costing a timeout every interval.
        self.failures += 1
        delay = backoff_delay(self.interval_s, self.failures)
        self._next_try = now + delay
        self.status.state, self.status.last_error = "down", message
        self.status.message = f"retrying in {delay:g} s"

    def test_connection(self) -> SourceStatus:
        """Poll once now, ignoring back-off; the status says what happened."""
        self._next_try = 0.0
        self.poll(time.time())
        return self.status

    def close(self) -> None:
        self.client.close()


class PrometheusSource(BackoffSource):
    """Scrapes one server's /metrics and normalises it; never raises from poll()."""

    def __init__(self, config: ServerConfig, window_s: float = 60.0) -> None:
        super().__init__(config, "unknown")
        self.url = metrics_url(config.url)
        self.normalizer = Normalizer(window_s)
        self.ollama_version = ""  # set when the server turns out to be Ollama

    def poll(self, now: float) -> Poll:
        if now < self._next_try:
            return Poll()
        try:
            if self.status.kind == "ollama":
                return self._up(now, self._read_ollama(), "")
            text = self._fetch_metrics()
            if text is None:  # no /metrics, but Ollama's API answered: read that from now on
                return self._up(now, self._read_ollama(), "")
            scrape = parse_metrics(text)
        except (MetricsError, ollama.OllamaError) as exc:
            where = "" if isinstance(exc, ollama.OllamaError) else f"{self.url} sent "
            self._fail(now, f"{where}{exc}")
            return Poll()
        except (FetchError, httpx.HTTPError, OSError) as exc:
            message = str(exc) if isinstance(exc, FetchError) else _describe(
                exc, self.url, self.config.timeout_s)
            self._fail(now, message)
            return Poll()
        if self.config.kind is None and self.status.kind in ("unknown", "prometheus"):
            # Labelled metrics appear only once observed, so an idle server may look plain.
            self.status.kind = detect_kind(scrape.names())
        values = self.normalizer.update(scrape, now)
        return self._up(now, values, f" from {len(scrape.names())} metrics")

    def _up(self, now: float, values: list[tuple[str, float]], detail: str) -> Poll:
        self.failures, self._next_try = 0, 0.0
        self.status.state, self.status.last_ok, self.status.last_error = "up", now, None
        self.status.message = f"{len(values)} series{detail}"
        if self.status.kind == "ollama":
            version = f"Ollama {self.ollama_version}; " if self.ollama_version else ""
            self.status.message += f" ({version}{ollama.NOT_PROVIDED})"
        return Poll([Sample(f"{self.name}/{series}", now, value) for series, value in values])

    def _fetch_metrics(self) -> str | None:
        """The /metrics text; None when there is none but the server is Ollama (detected by
        its GET /api/version, which then sets the kind)."""
        try:
            return self.fetch()
        except FetchError as exc:
            if exc.status_code != 404 or self.config.kind not in (None, "ollama"):
                raise
            version = self._ollama_version()
            if version is None:
                raise
        self.ollama_version, self.status.kind = version, "ollama"
        return None

    def _ollama_version(self) -> str | None:
        try:
            return ollama.parse_version(self.fetch(ollama.api_root(self.config.url)
                                                   + "/api/version"))
        except (FetchError, httpx.HTTPError, OSError):
            return None

    def _read_ollama(self) -> list[tuple[str, float]]:
        url = ollama.api_root(self.config.url) + "/api/ps"
        return ollama.ps_values(ollama.parse_ps(self.fetch(url), url))

    def fetch(self, url: str | None = None) -> str:
        """The body of ``url`` (the metrics URL by default), refusing one over the size limit."""
        url = url or self.url
        limit = self.config.max_bytes
        with self.client.stream("GET", url) as response:
            if response.status_code != 200:
                raise FetchError(f"{url} answered HTTP {response.status_code}",
                                 response.status_code)
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limit:
                    what = " of metrics" if url == self.url else ""
                    raise FetchError(f"{url} sent more than {limit / 2**20:g} MiB{what}")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")

