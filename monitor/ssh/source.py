"""SshSource: a server on a remote box's loopback read through an SSH tunnel, plus its GPUs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import httpx

from monitor.remote import backoff_delay
from monitor.ssh.target import parse_target
from monitor.ssh.tunnel import Connection, SshError
from monitor.types import Poll, Sample, SourceStatus

# Why an SSH source is down, or up without its GPUs (as monitor.types.REASONS, for the pane).
SSH_REASONS = {
    "ssh_unreachable": "the SSH host could not be reached",
    "ssh_auth": "the SSH server refused the login",
    "ssh_host_key_unknown": "the SSH host key is not in known_hosts",
    "ssh_host_key_changed": "the SSH host key changed since known_hosts saved it",
    "ssh_dropped": "the SSH connection dropped; reconnecting",
    "remote_port_closed": "nothing listens on the remote port",
    "no_nvidia_smi": "no nvidia-smi on the remote: no GPU series",
    "nvidia_smi_failed": "nvidia-smi failed on the remote: no GPU series",
    "ssh": "ssh failed (see the sentence)",
}
# Series a GPU exporter on the far side already gives (DCGM, Triton): then nvidia-smi's are
# not stored twice.
EXPORTER_GPU_SERIES = ("gpu_util_pct", "power_w", "memory_used_bytes")
FIRST_GPU_WAIT_S = 3.0


class SshSource:
    """Reads one server through ``ssh -L`` (its /metrics or a Prometheus API, by the source
    ``make_inner`` builds for the remote's own URL) and samples the box's GPUs with nvidia-smi
    over the same connection, as the series NvmlSource produces (``name/0/util_pct``).

    A failed login backs off exponentially; a dropped connection is reported and reconnected
    (what was read before the drop is kept). Never raises from poll()."""

    def __init__(self, config: Any, make_inner: Callable[[Any], Any] | None = None) -> None:
        from monitor.remote import PrometheusSource

        self.config = config
        self.target = parse_target(config.url)
        self.name, self.interval_s = config.name, config.interval_s
        # A private folder (mkdtemp: 0700) for the tunnel's socket.
        self._dir = tempfile.mkdtemp(prefix="servescope-ssh-")
        self.socket_path = os.path.join(self._dir, "tunnel")
        self.inner = (make_inner or PrometheusSource)(
            dataclasses.replace(config, url=self.target.http_url))
        self.inner.client.close()
        headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self.inner.client = httpx.Client(timeout=config.timeout_s, headers=headers,
                                         transport=httpx.HTTPTransport(uds=self.socket_path))
        self.status = SourceStatus(kind=self.inner.status.kind)
        self.connection: Connection | None = None
        self.failures = 0
        self._next_try = 0.0
        self._ssh_failed = 0
        self._exporter_gpus = False
        self._refusal: str | None = None  # ssh's word on the last scrape's refused connection

    def poll(self, now: float) -> Poll:
        if now < self._next_try:
            return Poll()
        if self.connection is not None and not self.connection.alive:
            return self._dropped(now)
        if self.connection is None:
            try:
                self._connect()
            except SshError as exc:
                self._fail(now, exc.reason, str(exc))
                return Poll()
        started, attempts = time.time(), self.inner.status.scrapes
        poll = self.inner.poll(now)
        if any(s.series.split("/", 1)[1].startswith(EXPORTER_GPU_SERIES) for s in poll.samples):
            self._exporter_gpus = True
        poll.samples += self._gpu_samples()
        inner = self.inner.status
        if inner.scrapes != attempts:  # a scrape was tried (not skipped in its back-off)
            failed = inner.state == "down" and inner.reason in ("error", "connect")
            self._refusal = self.connection.refused(started) if failed else None
        self._merge(now)
        return poll

    def _connect(self) -> None:
        connection = Connection(self.target, self.socket_path, self.interval_s)
        connection.open()
        self.connection = connection
        # A fresh tunnel: the scrape behind it need not wait out the old one's back-off.
        self.inner._next_try, self.inner.failures = 0.0, 0

    def _dropped(self, now: float) -> Poll:
        samples = self._gpu_samples()  # what arrived before the drop is kept
        why = self.connection.failure()
        self.connection.close()
        self.connection = None
        self._fail(now, "ssh_dropped", f"The SSH connection to {self.target.box} dropped "
                                       f"({why}).")
        return Poll(samples)

    def _gpu_samples(self) -> list[Sample]:
        if self.connection is None:
            return []
        rows = self.connection.take_rows()
        if self._exporter_gpus:
            return []
        return [Sample(f"{self.name}/{index}/{series}", ts, value)
                for ts, index, values in rows for series, value in values.items()]

    # ---- status
    def _publish(self, now: float, **fields: Any) -> None:
        state = fields.get("state", self.status.state)
        since = now if self.status.state != state else self.status.since
        self.status = dataclasses.replace(self.status, since=since, **fields)

    def _fail(self, now: float, reason: str, message: str) -> None:
        self.failures += 1
        self._ssh_failed += 1
        delay = backoff_delay(self.interval_s, self.failures)
        self._next_try = now + delay
        inner = self.inner.status
        self._publish(now, state="down", reason=reason, last_error=message,
                      message=f"retrying in {delay:g} s", scrapes=inner.scrapes + self._ssh_failed,
                      failed_scrapes=inner.failed_scrapes + self._ssh_failed)

    def _merge(self, now: float) -> None:
        """This source's status: the scrape's, with what SSH and nvidia-smi add to it."""
        self.failures, self._next_try = 0, 0.0
        inner = self.inner.status
        fields = {f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)
                  if f.name not in ("since",)}
        fields["scrapes"] = inner.scrapes + self._ssh_failed
        fields["failed_scrapes"] = inner.failed_scrapes + self._ssh_failed
        gpu = self.connection.gpu if self.connection is not None else None
        if self._refusal is not None and inner.state == "down":
            fields["reason"] = "remote_port_closed"
            fields["last_error"] = (f"Nothing listens on port {self.target.remote_port} of "
                                    f"{self.target.box} ({self._refusal}); is the server "
                                    "running there?")
        elif inner.state == "up" and gpu is not None and gpu.state in ("missing", "failed"):
            fields["reason"] = "no_nvidia_smi" if gpu.state == "missing" else "nvidia_smi_failed"
            fields["last_error"] = gpu.message
        if inner.state == "up":
            fields["message"] = f"{inner.message} through {self.target.box}{self._gpu_note(gpu)}"
        self._publish(now, **fields)

    def _gpu_note(self, gpu: Any) -> str:
        if gpu is None or gpu.state == "off":
            return ""
        if self._exporter_gpus:
            return "; GPUs from its own exporter"
        if gpu.state == "sampling":
            return f"; {len(gpu.gpus)} GPU(s) from nvidia-smi"
        return "; GPUs: waiting for nvidia-smi" if gpu.state == "starting" else "; no GPUs"

    def test_connection(self) -> SourceStatus:
        """Connect and scrape once now, ignoring back-off, waiting briefly for nvidia-smi's
        first answer; the status says what happened."""
        self._next_try = 0.0
        self.poll(time.time())
        deadline = time.monotonic() + FIRST_GPU_WAIT_S
        while (self.connection is not None and not _first_answer_complete(self.connection.gpu)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        if self.connection is not None and self.status.state == "up":
            self._merge(time.time())
        return self.status

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.inner.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir)


def server_source(config: Any, make_inner: Callable[[Any], Any] | None = None) -> Any:
    """The source reading ``config``: through SSH when its URL is ssh://, else ``make_inner``
    (a PrometheusSource by default) on the URL itself."""
    from monitor.remote import PrometheusSource
    from monitor.ssh.target import is_ssh_url

    if is_ssh_url(config.url):
        return SshSource(config, make_inner)
    return (make_inner or PrometheusSource)(config)


def _first_answer_complete(gpu: Any) -> bool:
    """Whether nvidia-smi's first answer is all in: it writes one row per GPU, one after another,
    so the count is known once a GPU answers a second time (on a loaded box the first row can
    arrive well before the second); or it has stopped, or was never asked."""
    if gpu.state == "starting":
        return False
    if gpu.state != "sampling":
        return True
    indices = [row[1] for row in list(gpu.rows)]
    return len(indices) != len(set(indices))
