"""The embedded engine as a source: step statistics and finished requests' own timings."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
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
                 window_s: float = LATENCY_WINDOW_S,
                 spec_summary: Callable[[], dict | None] | None = None) -> None:
        self.engine = engine
        # The speculative decoder's counters (engine.spec.decoder's summary), read each poll:
        # acceptance per draft position over the last window, as vLLM defines it.
        self.spec_summary = spec_summary
        self._spec_seen: deque[tuple[float, int, int, int, list[int]]] = deque()
        self.name = name
        self.interval_s = interval_s
        self.window_s = window_s
        self._recent: deque[tuple[float, float | None, float | None]] = deque()  # ts, ttft, tpot
        self.status = SourceStatus(state="up", kind="engine")
        self._finished: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._last_stamp: float | None = None
        # Quality canary scores of the loaded model (the Engine pane's "Score quality canary"),
        # judged against the first ones of the same model: a new model starts a new baseline.
        self._canary: list[tuple[str, Any]] = []
        self._canary_model: str | None = None
        self._canary_baseline: Any = None

    def add_canary(self, model: str, score: Any) -> None:
        """A quality canary score (monitor.canary.CanaryScore) of `model`, from any thread;
        the next poll emits it as `<name>/canary_perplexity`, `_tokens` and `_drift`."""
        with self._lock:
            self._canary.append((model, score))

    def add_finished(self, outputs: Iterable[Any]) -> None:
        """Called from the engine's thread with outputs whose request has finished."""
        records = [request_record(o, self.name) for o in outputs]
        with self._lock:
            self._finished.extend(records)

    def poll(self, now: float) -> Poll:
        with self._lock:
            requests, self._finished = self._finished, []
            canary, self._canary = self._canary, []
        latencies = (self._latency_samples(requests, now) + self._canary_samples(canary, now)
                     + self._spec_samples(now))
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

    def _spec_samples(self, now: float) -> list[Sample]:
        """Acceptance rate, mean accepted length (the bonus token counts) and acceptance at
        each draft position over the last window, from the decoder's running counters (vLLM's
        definitions, as monitor.normalize.RATIOS derives them from a server's)."""
        summary = self.spec_summary() if self.spec_summary is not None else None
        if not summary or not summary.get("drafts"):
            # Counters at zero are a reading too: the first drafts are judged from here, so
            # the acceptances before the next poll stay in the window (not only later ones).
            self._spec_seen = deque([(now, 0, 0, 0, [])])
            return []
        seen = (now, summary["drafts"], summary["accepted_tokens"], summary["draft_tokens"],
                list(summary.get("accepted_per_position") or []))
        if self._spec_seen and seen[1] < self._spec_seen[-1][1]:
            self._spec_seen.clear()  # a new model (or decoder): its counters start again
        self._spec_seen.append(seen)
        # The oldest reading inside the window is the base the increases are taken from.
        while len(self._spec_seen) > 1 and self._spec_seen[1][0] <= now - self.window_s:
            self._spec_seen.popleft()
        base = self._spec_seen[0] if len(self._spec_seen) > 1 else (now, 0, 0, 0, [])
        drafts, accepted, drafted = (seen[i] - base[i] for i in (1, 2, 3))
        if drafts <= 0 or drafted <= 0:
            return []
        p = f"{self.name}/"
        out = [Sample(p + "spec_acceptance_rate", now, accepted / drafted),
               Sample(p + "spec_mean_accepted_len", now, 1.0 + accepted / drafts)]
        for i, total in enumerate(seen[4]):
            before = base[4][i] if i < len(base[4]) else 0
            out.append(Sample(f"{p}spec_acceptance_rate_at[position={i}]", now,
                              (total - before) / drafts))
        return out

    def _canary_samples(self, scores: list[tuple[str, Any]], now: float) -> list[Sample]:
        from monitor.canary import CanaryBaseline, drift_ratio

        samples, p = [], f"{self.name}/"
        for model, score in scores:
            if model != self._canary_model:
                self._canary_model, self._canary_baseline = model, CanaryBaseline()
            self._canary_baseline.add(score.perplexity)
            samples += [Sample(p + "canary_perplexity", now, score.perplexity),
                        Sample(p + "canary_tokens", now, float(score.tokens))]
            if self._canary_baseline.value is not None:
                samples.append(Sample(p + "canary_drift", now,
                                      drift_ratio(score.perplexity, self._canary_baseline.value)))
        return samples

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
