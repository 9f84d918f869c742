"""Remote inference servers scraped over HTTP(S): timeouts, a size limit, back-off and a status."""

from __future__ import annotations

import abc
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import httpx

from monitor import ollama, openai_api
from monitor.drift import OutputDrift
from monitor.normalize import Normalizer, detect_kind
from monitor.promtext import MetricsError, parse_metrics
from monitor.types import Poll, Sample, SourceStatus

MAX_BACKOFF_S = 60.0
# Where a server kind names its version ({"version": "0.32.0"}), and how often to retry asking.
VERSION_PATHS = {"vllm": "/version", "servescope": "/version"}
VERSION_RETRY_S = 60.0
# The largest body a scrape reads: far above any real /metrics page (vLLM's is ~100 KiB), far
# below what would hurt the recorder; over it the scrape stops reading and the source is down.
DEFAULT_MAX_BYTES = 16 * 2**20


class FetchError(Exception):
    """A scrape that failed; the message is one sentence naming the URL, `reason` a key of
    monitor.types.REASONS."""

    def __init__(self, message: str, status_code: int | None = None,
                 reason: str = "error") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.reason = "http_status" if status_code is not None and reason == "error" else reason


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
    max_bytes: int = DEFAULT_MAX_BYTES
    dollars_per_hour: float | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme.lower() == "ssh":
            from monitor.ssh.target import parse_target  # here: monitor.ssh imports this module

            parse_target(self.url)  # a server on a remote box's loopback, through SSH
        elif parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{self.url!r} is not an http(s) or ssh:// URL; use e.g. "
                             "http://host:8000 or ssh://user@gpu-box/8000")
        if not self.name or "/" in self.name:
            raise ValueError(f"server name {self.name!r} must be non-empty and without '/'")
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.max_bytes <= 0:
            raise ValueError("interval, timeout and size limit must be positive")


def backoff_delay(interval_s: float, failures: int) -> float:
    """Seconds to wait after `failures` failures in a row: doubling, at most MAX_BACKOFF_S."""
    return min(interval_s * 2 ** (failures - 1), MAX_BACKOFF_S)


def describe_error(exc: Exception, url: str, timeout_s: float) -> str:
    """One sentence for a failed HTTP request to `url`."""
    return classify_error(exc, url, timeout_s)[1]


def classify_error(exc: Exception, url: str, timeout_s: float) -> tuple[str, str]:
    """(reason, sentence) for a failed request to `url`; reason is a key of REASONS."""
    if isinstance(exc, FetchError):
        return exc.reason, str(exc)
    text = str(exc)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):  # aiohttp times out with these
        return "timeout", f"{url} did not answer within {timeout_s:g} s"
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower():
        return "tls", f"the TLS certificate of {url} could not be verified ({text})"
    if isinstance(exc, httpx.ConnectError):
        reason = "refused" if "refused" in text.lower() else "connect"
        return reason, f"cannot connect to {url} ({text})"
    return "error", f"{url} failed: {text or type(exc).__name__}"


def read_body(response: httpx.Response, url: str, limit: int, deadline: float,
              timeout_s: float, what: str = "") -> bytes:
    """The whole body of a streamed response, refusing one over `limit` bytes (announced or
    sent) or still arriving at `deadline` (time.monotonic()).

    httpx's timeout bounds each read, not the answer: a server sending one byte every 0.5 s
    never trips it. Checking the deadline after every chunk does, at most one read late."""
    announced = response.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > limit:
        raise FetchError(f"{url} announced {int(announced) / 2**20:.1f} MiB{what}, more than "
                         f"the {limit / 2**20:g} MiB cap", reason="too_large")
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise FetchError(f"{url} sent more than {limit / 2**20:g} MiB{what}",
                             reason="too_large")
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise FetchError(f"{url} did not finish its answer within {timeout_s:g} s "
                             f"({size} bytes received)", reason="timeout")
    return b"".join(chunks)


def decode_text(body: bytes, url: str) -> str:
    """The body as text; the exposition format is UTF-8, and replacing bad bytes would store
    garbage names quietly, so invalid bytes fail the scrape instead."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FetchError(f"{url} sent bytes that are not UTF-8 (at byte {exc.start} of "
                         f"{len(body)})", reason="invalid_utf8") from exc


class BackoffSource(abc.ABC):
    """What every polled HTTP source shares: an up/down status with its reason, a deadline per
    scrape, exponential back-off after failures, a "test connection" that ignores the back-off,
    and closing its client."""

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
        self._deadline = 0.0

    @abc.abstractmethod
    def poll(self, now: float) -> Poll:
        """Read the source once; never raises (failures go to `status`)."""

    def _begin_scrape(self) -> None:
        """Start one attempt: it counts, and every request in it shares one deadline (reset to
        0.0, "none", when the attempt ends)."""
        self.status.scrapes += 1
        self._deadline = time.monotonic() + self.config.timeout_s

    def _current_deadline(self) -> float:
        # A request made outside poll() (a backfill, a one-off query) gets a deadline of its own.
        return self._deadline or time.monotonic() + self.config.timeout_s

    def _stream(self, url: str, **kw):
        # Each request may wait only for what is left of the scrape's deadline (the floor keeps
        # a late request from a zero timeout, which httpx would read as "no timeout").
        left = max(0.05, self._current_deadline() - time.monotonic())
        return self.client.stream("GET", url, timeout=left, **kw)

    def _read(self, response: httpx.Response, url: str, what: str = "") -> bytes:
        return read_body(response, url, self.config.max_bytes, self._current_deadline(),
                         self.config.timeout_s, what)

    def _publish(self, now: float, state: str, **fields) -> None:
        since = now if self.status.state != state else self.status.since
        # One new object, assigned at once: a reader on another thread (the Servers pane, the
        # hub's statuses()) never sees the new state beside the previous reason.
        self.status = replace(self.status, state=state, since=since, **fields)

    def _fail(self, now: float, message: str, reason: str = "error", *,
              backoff: bool = True) -> None:
        retry = ""
        if backoff:
            # Exponential back-off keeps a dead server from costing a timeout every interval;
            # one that answered (with unusable values) keeps its schedule.
            self.failures += 1
            delay = backoff_delay(self.interval_s, self.failures)
            self._next_try = now + delay
            retry = f"retrying in {delay:g} s"
        self._publish(now, "down", last_error=message, reason=reason, message=retry,
                      failed_scrapes=self.status.failed_scrapes + 1)

    def _ok(self, now: float, message: str, warning: str | None = None) -> None:
        self.failures, self._next_try = 0, 0.0
        self._publish(now, "up", last_ok=now, last_error=warning, reason=None, message=message)

    def test_connection(self) -> SourceStatus:
        """Poll once now, ignoring back-off; the status says what happened."""
        self._next_try = 0.0
        self.poll(time.time())
        return self.status

    def close(self) -> None:
        self.client.close()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class PrometheusSource(BackoffSource):
    """Scrapes one server's /metrics and normalises it; never raises from poll()."""

    def __init__(self, config: ServerConfig, window_s: float = 60.0,
                 drift: OutputDrift | None = None) -> None:
        super().__init__(config, "unknown")
        self.url = metrics_url(config.url)
        self.normalizer = Normalizer(window_s, drift)
        self.ollama_version = ""  # set when the server turns out to be Ollama
        # Set when the server has no Prometheus text but answers GET /v1/models: read from then
        # on through that (monitor/openai_api.py).
        self.api_only = False
        self._version_tried = -math.inf

    def poll(self, now: float) -> Poll:
        if now < self._next_try:
            return Poll()
        self._begin_scrape()
        try:
            if self.status.kind == "ollama":
                return self._up(now, self._read_ollama(), "")
            if self.api_only:
                return self._up(now, self._read_models(), "")
            text = self._fetch_metrics()
            if text is None:  # no /metrics, but Ollama's or an OpenAI API answered: read that
                return self._up(now, self._read_ollama() if self.status.kind == "ollama"
                                else self._read_models(), "")
            try:
                scrape = parse_metrics(text)
            except MetricsError:
                # JSON or HTML where Prometheus text should be (trtllm-serve's /metrics is
                # JSON): a server whose OpenAI API answers is watched through that instead.
                if self._api_only_server():
                    return self._up(now, self._read_models(), "")
                raise
        except MetricsError as exc:
            self._fail(now, f"{self.url} sent {exc}", "not_prometheus")
            return Poll()
        except (ollama.OllamaError, openai_api.OpenAIApiError) as exc:
            self._fail(now, str(exc), "not_prometheus")
            return Poll()
        except (FetchError, httpx.HTTPError, OSError) as exc:
            reason, message = classify_error(exc, self.url, self.config.timeout_s)
            self._fail(now, message, reason)
            return Poll()
        finally:
            self._deadline = 0.0
        self.status.non_finite = scrape.non_finite
        self.status.non_finite_total += scrape.non_finite
        if scrape.non_finite and not scrape.samples:
            # Every value was NaN/±Inf: nothing can be stored, so "up" would be a lie.
            self._fail(now, f"{self.url} sent only NaN or ±Inf values "
                            f"({_plural(scrape.non_finite, 'sample')}, e.g. "
                            f"{', '.join(scrape.non_finite_names)}); nothing to store",
                       "non_finite", backoff=False)
            return Poll()
        if self.config.kind is None and self.status.kind in ("unknown", "prometheus"):
            # Labelled metrics appear only once observed, so an idle server may look plain.
            self.status.kind = detect_kind(scrape.names())
        if self.status.kind in VERSION_PATHS and self.status.version is None:
            self._read_version(now)
        values = self.normalizer.update(scrape, now)
        skipped = (f", {_plural(scrape.non_finite, 'NaN/±Inf value')} skipped"
                   if scrape.non_finite else "")
        return self._up(now, values, f" from {len(scrape.names())} metrics{skipped}")

    def _up(self, now: float, values: list[tuple[str, float]], detail: str) -> Poll:
        message = f"{len(values)} series{detail}"
        if self.status.kind == "ollama":
            version = f"Ollama {self.ollama_version}; " if self.ollama_version else ""
            message += f" ({version}{ollama.NOT_PROVIDED})"
        elif self.api_only:
            message += f" ({openai_api.NOT_PROVIDED})"
        self._ok(now, message)
        return Poll([Sample(f"{self.name}/{series}", now, value) for series, value in values])

    def _read_version(self, now: float) -> None:
        """The server's version from its version endpoint; tried once a minute until it answers
        (a failure here never fails the scrape: the metrics were read)."""
        if now - self._version_tried < VERSION_RETRY_S:
            return
        self._version_tried = now
        parts = urlsplit(self.config.url)
        url = f"{parts.scheme}://{parts.netloc}{VERSION_PATHS[self.status.kind]}"
        try:
            version = json.loads(self.fetch(url)).get("version")
        except (FetchError, httpx.HTTPError, OSError, ValueError, AttributeError):
            return
        if isinstance(version, str) and version.strip():
            self.status.version = version.strip()[:80]

    def _fetch_metrics(self) -> str | None:
        """The /metrics text; None when there is none but the server is Ollama (detected by
        its GET /api/version, which then sets the kind) or answers the OpenAI API's GET
        /v1/models (llama.cpp without --metrics answers 501 there, most others 404)."""
        try:
            return self.fetch()
        except FetchError as exc:
            if exc.status_code not in (404, 501) or self.config.kind not in (None, "ollama"):
                raise
            version = self._ollama_version() if exc.status_code == 404 else None
            if version is None:
                if self._api_only_server():
                    return None
                raise
        self.ollama_version, self.status.kind = version, "ollama"
        return None

    def _api_only_server(self) -> bool:
        """Whether a server of no configured kind answers GET /v1/models with a model list;
        if so it is read through that from now on, its kind named by the models' owner."""
        if self.config.kind is not None:
            return False
        try:
            models = self._models()
        except (FetchError, openai_api.OpenAIApiError, httpx.HTTPError, OSError):
            return False
        self.api_only, self.status.kind = True, openai_api.kind_of(models)
        self.status.api_only = True
        return True

    def _models(self) -> list[dict]:
        url = openai_api.models_url(self.config.url)
        return openai_api.parse_models(self.fetch(url), url)

    def _read_models(self) -> list[tuple[str, float]]:
        return openai_api.model_values(self._models())

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
        """The body of ``url`` (the metrics URL by default) as UTF-8 text, refusing one over the
        size limit or past the scrape's deadline."""
        url = url or self.url
        with self._stream(url) as response:
            if response.status_code != 200:
                raise FetchError(f"{url} answered HTTP {response.status_code}",
                                 response.status_code)
            body = self._read(response, url, " of metrics" if url == self.url else "")
        return decode_text(body, url)
