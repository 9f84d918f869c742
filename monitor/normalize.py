"""One table from every server kind's metric names to servescope's series, and the normaliser."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from monitor.promtext import Labels, Scrape
from monitor.quantiles import bucket_deltas, counter_delta, histogram_quantile, sum_by_le

QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class MetricMap:
    """One remote metric feeding one servescope series (first present entry per series wins)."""

    series: str
    remote: str
    type: str  # "gauge", "counter" or "histogram" (remote = the family name before _bucket)
    scale: float = 1.0
    labels: Labels = ()
    agg: str = "sum"  # how label sets combine: "sum" or "mean"
    per: str | None = None  # split into one series per value of this label (DCGM's gpu)


def _m(series: str, remote: str, type_: str, scale: float = 1.0, **kw) -> MetricMap:
    return MetricMap(series, remote, type_, scale, **kw)


TABLE: tuple[MetricMap, ...] = (
    # Latency histograms, in seconds.
    _m("ttft_s", "vllm:time_to_first_token_seconds", "histogram"),
    _m("ttft_s", "sglang:time_to_first_token_seconds", "histogram"),
    _m("ttft_s", "trtllm_time_to_first_token_seconds", "histogram"),
    _m("ttft_s", "nv_inference_first_response_histogram_ms", "histogram", 1e-3),
    _m("itl_s", "vllm:inter_token_latency_seconds", "histogram"),
    _m("itl_s", "vllm:time_per_output_token_seconds", "histogram"),
    _m("itl_s", "sglang:inter_token_latency_seconds", "histogram"),
    _m("itl_s", "sglang:time_per_output_token_seconds", "histogram"),
    _m("tpot_s", "vllm:request_time_per_output_token_seconds", "histogram"),
    _m("tpot_s", "tgi_request_mean_time_per_token_duration", "histogram"),
    _m("tpot_s", "trtllm_time_per_output_token_seconds", "histogram"),
    _m("e2e_s", "vllm:e2e_request_latency_seconds", "histogram"),
    _m("e2e_s", "sglang:e2e_request_latency_seconds", "histogram"),
    _m("e2e_s", "tgi_request_duration", "histogram"),
    _m("e2e_s", "trtllm_e2e_request_latency_seconds", "histogram"),
    _m("queue_s", "vllm:request_queue_time_seconds", "histogram"),
    _m("queue_s", "sglang:queue_time_seconds", "histogram"),
    _m("queue_s", "tgi_request_queue_duration", "histogram"),
    _m("queue_s", "trtllm_request_queue_time_seconds", "histogram"),
    # Scheduler state.
    _m("requests_running", "vllm:num_requests_running", "gauge"),
    _m("requests_running", "sglang:num_running_reqs", "gauge"),
    _m("requests_running", "tgi_batch_current_size", "gauge"),
    _m("requests_running", "llamacpp:requests_processing", "gauge"),
    _m("requests_running", "trtllm_num_requests_running", "gauge"),
    _m("requests_running", "nv_trt_llm_request_metrics", "gauge",
       labels=(("request_type", "active"),)),
    _m("requests_waiting", "vllm:num_requests_waiting", "gauge"),
    _m("requests_waiting", "sglang:num_queue_reqs", "gauge"),
    _m("requests_waiting", "tgi_queue_size", "gauge"),
    _m("requests_waiting", "llamacpp:requests_deferred", "gauge"),
    _m("requests_waiting", "trtllm_num_requests_waiting", "gauge"),
    _m("requests_waiting", "nv_trt_llm_request_metrics", "gauge",
       labels=(("request_type", "waiting"),)),
    # KV-cache usage as a 0-1 fraction.
    _m("kv_cache_usage", "vllm:kv_cache_usage_perc", "gauge", agg="mean"),
    _m("kv_cache_usage", "vllm:gpu_cache_usage_perc", "gauge", agg="mean"),
    _m("kv_cache_usage", "sglang:token_usage", "gauge", agg="mean"),
    _m("kv_cache_usage", "llamacpp:kv_cache_usage_ratio", "gauge", agg="mean"),
    _m("kv_cache_usage", "trtllm_kv_cache_utilization", "gauge", agg="mean"),
    _m("kv_cache_usage", "nv_trt_llm_kv_cache_block_metrics", "gauge", agg="mean",
       labels=(("kv_cache_block_type", "fraction"),)),
    # Token and request counters, turned into per-second rates.
    _m("prompt_tokens", "vllm:prompt_tokens_total", "counter"),
    _m("prompt_tokens", "sglang:prompt_tokens_total", "counter"),
    _m("prompt_tokens", "tgi_request_input_length_sum", "counter"),
    _m("prompt_tokens", "llamacpp:prompt_tokens_total", "counter"),
    _m("prompt_tokens", "trtllm_prompt_tokens_total", "counter"),
    _m("generation_tokens", "vllm:generation_tokens_total", "counter"),
    _m("generation_tokens", "sglang:generation_tokens_total", "counter"),
    _m("generation_tokens", "tgi_request_generated_tokens_sum", "counter"),
    _m("generation_tokens", "llamacpp:tokens_predicted_total", "counter"),
    _m("generation_tokens", "trtllm_generation_tokens_total", "counter"),
    _m("requests_finished", "vllm:request_success_total", "counter"),
    _m("requests_finished", "sglang:num_requests_total", "counter"),
    _m("requests_finished", "tgi_request_success", "counter"),
    _m("requests_finished", "trtllm_request_success_total", "counter"),
    _m("requests_finished", "nv_inference_request_success", "counter"),
    _m("preemptions", "vllm:num_preemptions_total", "counter"),
    # GPUs through DCGM (profiling ratios 0-1 become percent, like GPM) and Triton.
    _m("gpu_util_pct", "DCGM_FI_DEV_GPU_UTIL", "gauge", per="gpu"),
    _m("gpu_util_pct", "nv_gpu_utilization", "gauge", 100.0, per="gpu_uuid"),
    _m("sm_active_pct", "DCGM_FI_PROF_SM_ACTIVE", "gauge", 100.0, per="gpu"),
    _m("sm_occupancy_pct", "DCGM_FI_PROF_SM_OCCUPANCY", "gauge", 100.0, per="gpu"),
    _m("tensor_active_pct", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", 100.0, per="gpu"),
    _m("dram_active_pct", "DCGM_FI_PROF_DRAM_ACTIVE", "gauge", 100.0, per="gpu"),
    _m("memory_used_bytes", "DCGM_FI_DEV_FB_USED", "gauge", 1024.0 * 1024.0, per="gpu"),
    _m("power_w", "DCGM_FI_DEV_POWER_USAGE", "gauge", per="gpu"),
    _m("power_w", "nv_gpu_power_usage", "gauge", per="gpu_uuid"),
    _m("temperature_c", "DCGM_FI_DEV_GPU_TEMP", "gauge", per="gpu"),
    _m("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "gauge", per="gpu"),
    _m("energy_j", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", 1e-3, per="gpu"),
)

KIND_PREFIXES = (("vllm", "vllm:"), ("sglang", "sglang:"), ("tgi", "tgi_"),
                 ("llamacpp", "llamacpp:"), ("trtllm", "trtllm_"), ("triton", "nv_inference_"),
                 ("dcgm", "DCGM_FI_"))


def detect_kind(names: set[str]) -> str:
    """The server kind whose metric prefix most names carry, else "prometheus"."""
    counts = {kind: sum(1 for n in names if n.startswith(p)) for kind, p in KIND_PREFIXES}
    kind, hits = max(counts.items(), key=lambda kv: kv[1])
    return kind if hits else "prometheus"


def _matching(scrape: Scrape, name: str, want: Labels) -> list[tuple[Labels, float]]:
    return [(labels, v) for labels, v in scrape.values(name)
            if all(pair in labels for pair in want)]


def _split(rows: list[tuple[Labels, float]], per: str | None) -> dict[str, list]:
    if per is None:
        return {"": rows}
    groups: dict[str, list] = {}
    for labels, value in rows:
        groups.setdefault(f"[{per}={dict(labels).get(per, '')}]", []).append((labels, value))
    return groups


def _without(labels: Labels, name: str) -> Labels:
    return tuple(p for p in labels if p[0] != name)


def _group_total(rows: Iterable[tuple[Labels, float]], agg: str) -> float:
    values = [v for _, v in rows]
    return sum(values) / len(values) if agg == "mean" else sum(values)


class Normalizer:
    """Turns successive scrapes of one server into servescope series values.

    Gauges pass through (scaled); counters become per-second rates with reset handling;
    histograms become p50/p95/p99 and mean over a sliding window of bucket increases, plus the
    cumulative observation count.
    """

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._counters: dict[tuple[str, Labels], tuple[float, float]] = {}
        self._hist: dict[str, tuple[dict, dict, dict]] = {}
        self._windows: dict[str, deque] = {}
        self._last_scrape: float | None = None

    def update(self, scrape: Scrape, now: float) -> list[tuple[str, float]]:
        """Series values from one scrape taken at `now` (seconds)."""
        out: list[tuple[str, float]] = []
        done: set[str] = set()
        names = scrape.names()
        for m in TABLE:
            probe = m.remote + "_bucket" if m.type == "histogram" else m.remote
            if m.series in done or probe not in names or not _matching(scrape, probe, m.labels):
                continue
            done.add(m.series)
            if m.type == "gauge":
                out += self._gauge(m, scrape)
            elif m.type == "counter":
                out += self._counter(m, scrape, now)
            else:
                out += self._histogram(m, scrape, now)
        self._last_scrape = now
        return [(name, v) for name, v in out if math.isfinite(v)]

    def _gauge(self, m: MetricMap, scrape: Scrape) -> list[tuple[str, float]]:
        groups = _split(_matching(scrape, m.remote, m.labels), m.per)
        return [(m.series + suffix, _group_total(rows, m.agg) * m.scale)
                for suffix, rows in groups.items()]

    def _counter(self, m: MetricMap, scrape: Scrape, now: float) -> list[tuple[str, float]]:
        out = []
        for suffix, rows in _split(_matching(scrape, m.remote, m.labels), m.per).items():
            increase, dt = 0.0, None
            for labels, value in rows:
                prev = self._counters.get((m.remote, labels))
                if prev is None and self._last_scrape is not None:
                    prev = (self._last_scrape, 0.0)  # born since the last scrape: counts from 0
                self._counters[(m.remote, labels)] = (now, value)
                if prev is not None and now > prev[0]:
                    increase += counter_delta(prev[1], value)
                    dt = now - prev[0]
            if dt:
                out.append((f"{m.series}_per_s{suffix}", increase * m.scale / dt))
        return out

    def _histogram(self, m: MetricMap, scrape: Scrape, now: float) -> list[tuple[str, float]]:
        buckets: dict[Labels, dict[float, float]] = {}
        for labels, value in _matching(scrape, m.remote + "_bucket", m.labels):
            try:
                le = float(dict(labels)["le"])
            except (KeyError, ValueError):
                continue
            buckets.setdefault(_without(labels, "le"), {})[le] = value
        sums = dict(scrape.values(m.remote + "_sum"))
        counts = dict(scrape.values(m.remote + "_count"))
        total = sum(b.get(math.inf, 0.0) for b in buckets.values())
        out = [(f"{m.series}_count", total)]
        prev = self._hist.get(m.remote)
        if prev is None and self._last_scrape is not None:
            prev = ({}, {}, {})  # the family appeared since the last scrape: all of it is new
        self._hist[m.remote] = (buckets, sums, counts)
        if prev is None:
            return out  # what happened before the first scrape is outside every window
        deltas = sum_by_le(bucket_deltas(prev[0].get(k, {}), b) for k, b in buckets.items())
        dsum = sum(counter_delta(prev[1].get(k, 0.0), v) for k, v in sums.items())
        dcount = sum(counter_delta(prev[2].get(k, 0.0), v) for k, v in counts.items())
        window = self._windows.setdefault(m.remote, deque())
        window.append((now, deltas, dsum, dcount))
        while window and window[0][0] <= now - self.window_s:
            window.popleft()
        merged = sum_by_le(d for _, d, _, _ in window)
        if not merged or merged[-1][1] <= 0:
            return out
        out += [(f"{m.series}_p{round(q * 100)}", histogram_quantile(q, merged) * m.scale)
                for q in QUANTILES]
        n = sum(w[3] for w in window)
        if n > 0:
            out.append((f"{m.series}_mean", sum(w[2] for w in window) / n * m.scale))
        return out
