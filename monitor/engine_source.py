"""The embedded engine as a source: step statistics and finished requests' own timings."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from monitor.types import Poll, RequestRecord, Sample, SourceStatus


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

    def __init__(self, engine: Any, name: str = "engine", interval_s: float = 0.5) -> None:
        self.engine = engine
        self.name = name
        self.interval_s = interval_s
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
        stats = getattr(self.engine, "last_stats", None)
        if stats is None or stats.timestamp == self._last_stamp:
            return Poll(requests=requests)  # no new step since the last poll
        self._last_stamp = stats.timestamp
        p = f"{self.name}/"
        samples = [Sample(p + "requests_running", now, stats.num_running),
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

    def close(self) -> None:
        pass
