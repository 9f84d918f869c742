"""The server's own latency estimates over exactly a load test's requests, to store beside the
client's exact percentiles.

The monitor's live quantiles come from a sliding window (a minute for vLLM-style sources), which
rarely lines up with a load test: other requests fall in, some of the run's fall out. Here the
server's /metrics is read once just before the run's first request and again once the server
has counted every request the client saw complete, and the quantiles are taken from the bucket
increases between the two reads, through the monitor's own normaliser (so every server kind it
reads is covered, with the bucket interval each estimate lies in). Requests other clients sent
meanwhile are counted too; `requests` says how many the server counted, to set against the
client's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from monitor.remote import PrometheusSource, ServerConfig, metrics_url

# The latencies compared, as the load generator's summary names them (`<name>_ms`) and as the
# normaliser's series.
LATENCIES = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
PERCENTILES = (50, 95, 99)
# A server records a request's histograms as it finishes it, a moment after the client has the
# last byte: how long to wait for it to count them all.
SETTLE_S = 15.0
POLL_S = 0.25


class ServerWindow:
    """Open before a run's first request, `close` after its last; never raises: a server without
    usable /metrics gives {"unavailable": sentence}."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = metrics_url(url)
        self.clock = clock
        # An unbounded window: every increase between the first read and the last one counts.
        self.source = PrometheusSource(ServerConfig("run", url, token=token, timeout_s=timeout_s),
                                       window_s=math.inf)
        self.problem: str | None = None
        self.start: dict[str, float] | None = self._read()
        if self.start is not None and not any(f"{s}_count" in self.start
                                              for s in LATENCIES.values()):
            self.start, self.problem = None, (f"{self.url} has no latency histograms the "
                                              "monitor reads")

    def _read(self) -> dict[str, float] | None:
        """The normalised series of one read, by series name; None (and `problem`) on failure."""
        poll = self.source.poll(self.clock())
        if self.source.status.state != "up":
            self.problem = self.source.status.last_error or f"{self.url} could not be read"
            return None
        return {s.series.split("/", 1)[1]: s.value for s in poll.samples}

    def close(self, completed: int, settle_s: float = SETTLE_S) -> dict:
        """The server's estimates since opening, once it has counted `completed` more requests
        and has none running or waiting (or after `settle_s`: then "settled" is False)."""
        try:
            if self.start is None:
                return {"unavailable": self.problem}
            deadline = time.monotonic() + settle_s
            while True:
                end = self._read()
                if end is None:
                    return {"unavailable": self.problem}
                counted = self._counted(end)
                idle = end.get("requests_running", 0) + end.get("requests_waiting", 0) == 0
                settled = counted >= completed and idle
                if settled or time.monotonic() >= deadline:
                    return self._estimates(end, counted, settled)
                time.sleep(POLL_S)
        finally:
            self.source.close()

    def _counted(self, end: dict[str, float]) -> int:
        """Requests the server finished since opening, by its first latency histogram's count."""
        for series in ("e2e_s", "ttft_s", "tpot_s", "itl_s"):
            key = f"{series}_count"
            if key in end:
                return round(end[key] - self.start.get(key, 0.0))
        return 0

    def _estimates(self, end: dict[str, float], counted: int, settled: bool) -> dict:
        out: dict = {"url": self.url, "kind": self.source.status.kind, "requests": counted,
                     "settled": settled}
        if self.source.status.version:
            out["version"] = self.source.status.version
        for name, series in LATENCIES.items():
            per = {}
            for p in PERCENTILES:
                key = f"{series}_p{p}"
                if key in end:
                    # Absent ends are None (JSON has no NaN or Infinity): a missing _hi is the
                    # last bucket's, unbounded above.
                    lo, hi = end.get(key + "_lo"), end.get(key + "_hi")
                    per[f"p{p}"] = {"estimate": end[key] * 1e3,
                                    "lo": None if lo is None else lo * 1e3,
                                    "hi": None if hi is None else hi * 1e3}
            if per:
                out[f"{name}_ms"] = per
        return out


def inside(exact: float | None, estimate: dict) -> bool | None:
    """Whether an exact value lies in an estimate's bucket (lo, hi]; None when unknown."""
    if exact is None or estimate.get("lo") is None:
        return None
    hi = estimate.get("hi")
    return estimate["lo"] < exact and (hi is None or exact <= hi)
