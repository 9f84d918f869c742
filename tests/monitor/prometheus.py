"""A real Prometheus server (Debian's `prometheus` package) on 127.0.0.1 for the tests: it
scrapes one target every second as one job, and writes its log beside its data."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

PROMETHEUS = shutil.which("prometheus")
SKIP_REASON = "no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, job: str, target: str) -> Iterator[str]:
    """Prometheus scraping `target` (host:port) every second as `job`; yields its URL once it
    has scraped the target once. Its log goes to a file (a pipe nobody reads would fill up and
    stall it over a long session)."""
    if PROMETHEUS is None:
        pytest.skip(SKIP_REASON)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: {job}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n")
    port = _free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_scrapes(url, job, 1, proc, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def wait_for_scrapes(url: str, job: str, scrapes: int, proc: subprocess.Popen | None = None,
                     log: Path | None = None, timeout_s: float = 30.0) -> None:
    """Until Prometheus holds `scrapes` scrapes of `job` in the last minute."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"prometheus exited: {log.read_text(errors='replace')[-2000:]}"
                        if log else "prometheus exited")
        try:
            answer = httpx.get(f"{url}/api/v1/query", params={
                "query": f'count_over_time(up{{job="{job}"}}[1m])'}).json()
            result = answer["data"]["result"]
            if result and float(result[0]["value"][1]) >= scrapes:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # still starting: not answering yet
        time.sleep(0.3)
    pytest.fail(f"prometheus did not scrape {job} {scrapes} times within {timeout_s:g} s")
