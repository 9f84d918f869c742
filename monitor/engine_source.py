"""The embedded engine as a source: step statistics and finished requests' own timings."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from monitor.types import Poll, RequestRecord, Sample, SourceStatus

# The latency series are exact percentiles over the requests that finished in the last minute
# (a remote server's are estimated from its histograms over the same span: monitor.normalize).
LATENCY_WINDOW_S = 60.0
PERCENTILES = (50, 95, 99)


def request_record(output: Any, source: str, now: float | None = None) -> RequestRecord:
    """A RequestRecord from a finished engine output (its `.metrics` use the engine's clock)."""
    m = output.metrics
    e2e = None if m.finished is None else m.finished - m.arrival
    return RequestRecord(source=source, ts=time.time() if now is None else now,
                         ttft_s=m.ttft_s, tpot_s=m.tpot_s, e2e_s=e2e, itl_s=list(m.itl_s),
                         prompt_tokens=m.prompt_tokens, output_tokens=m.generated_tokens,
                         ok=getattr(output, "finish_reason", "stop") != "abort")


class EngineSource:
    """Reads `engine.last_stats` each poll; finished outputs are handed in with `add_finished`."""

    def __init__(self, engine: Any, name: str = "engine", interval_s: float = 0.5,
                 window_s: float = LATENCY_WINDOW_S) -> None:
        self.engine = engine
        self.name = name
        self.interval_s = interval_s
        self.window_s = window_s
        self._recent: deque[tuple[float, float | None, float | None]] = deque()  # ts, ttft, tpot
        self.status = SourceStatus(state="up", kind="engine")
        self._finished: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._last_stamp: float | None = None

    def add_finished(self, outputs: Iterable[Any]) -> None:
        """Called from the engine's thread with outputs whose request has finished."""
        records = [request_record(o, self.name) for o in outputs]
        with self._lock:
            self._finished.extend(records)

    def poll(self, now: float) -> Poll:
        with self._lock:
            requests, self._finished = self._finished, []
        latencies = self._latency_samples(requests, now)
        stats = getattr(self.engine, "last_stats", None)
        if stats is None or stats.timestamp == self._last_stamp:
            return Poll(latencies, requests)  # no new step since the last poll
        self._last_stamp = stats.timestamp
        p = f"{self.name}/"
        samples = latencies + [Sample(p + "requests_running", now, stats.num_running),
                   Sample(p + "requests_waiting", now, stats.num_waiting),
                   Sample(p + "preemptions", now, stats.num_preempted)]
        if stats.kv_blocks_total:
            samples.append(Sample(p + "kv_cache_usage", now,
                                  stats.kv_blocks_used / stats.kv_blocks_total))
        if stats.wall_s > 0:
            samples.append(Sample(p + "step_tokens_per_s", now,
                                  (stats.num_prefill_tokens + stats.num_decode_tokens)
                                  / stats.wall_s))
            samples.append(Sample(p + "decode_tokens_per_s", now,
                                  stats.num_decode_tokens / stats.wall_s))
        return Poll(samples, requests)

    def _latency_samples(self, finished: list[RequestRecord], now: float) -> list[Sample]:
        """``ttft_s_p50`` ... ``tpot_s_p99``: exact percentiles (numpy's linear interpolation,
        as the load test's) of the requests finished in the last ``window_s``; none while the
        window holds no request."""
        self._recent.extend((now, r.ttft_s, r.tpot_s) for r in finished if r.ok)
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        samples = []
        for index, metric in ((1, "ttft_s"), (2, "tpot_s")):
            values = np.array([r[index] for r in self._recent if r[index] is not None], float)
            if values.size:
                samples += [Sample(f"{self.name}/{metric}_p{q}", now,
                                   float(np.percentile(values, q))) for q in PERCENTILES]
        return samples

    def close(self) -> None:
        pass
