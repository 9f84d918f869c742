"""One table from every server kind's metric names to servescope's series, and the normaliser."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from monitor.drift import OutputDrift, bucket_counts
from monitor.promtext import Labels, Scrape
from monitor.quantiles import (
    bucket_deltas,
    counter_delta,
    histogram_quantile,
    quantile_interval,
    sum_by_le,
)

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
    per_as: str | None = None  # the name the split label gets in the series (default: per)
    values: tuple[tuple[str, str], ...] = ()  # the split label's values renamed (normalised)
    # Labels whose values name copies of one state (SGLang's tp_rank/pp_rank: every scheduler of
    # one data-parallel rank reports the same batch when it reports at all): only the lowest
    # copy is read, so copies are not added up.
    replicas: tuple[str, ...] = ()
    # Further families of the same type added into the series (llama.cpp counts cached prompt
    # tokens apart from the processed ones).
    also: tuple[str, ...] = ()
    # A gauge read only while this gauge is above zero (SGLang sends its speculative-decoding
    # gauges as 0 when speculative decoding is off: no acceptance, not zero acceptance).
    only_if: str | None = None


def _m(series: str, remote: str, type_: str, scale: float = 1.0, **kw) -> MetricMap:
    return MetricMap(series, remote, type_, scale, **kw)


# Why requests finished, in one vocabulary across servers: stop (EOS or a stop string), length
# (max_tokens or the context), abort (the client went away or cancelled), error.
FINISHED_REASONS = (("stop", "stop"), ("eos", "stop"), ("stop_sequence", "stop"),
                    ("length", "length"), ("max_tokens", "length"), ("abort", "abort"),
                    ("aborted", "abort"), ("cancelled", "abort"), ("error", "error"))


@dataclass(frozen=True)
class Ratio:
    """A series derived from two counters' increases over the sliding window:
    offset + numerator / denominator (per value of the numerator's split label, if any)."""

    series: str
    numerator: str
    denominator: str
    offset: float = 0.0
    # A numerator absent while the denominator grew means none: SGLang creates its cached-token
    # counter at the first hit.
    absent_is_zero: bool = False


# The series whose distribution is compared with the source's baseline (monitor/drift.py).
DRIFT_HISTOGRAMS = {"request_generation_tokens": "response_length"}
DRIFT_COUNTERS = {"requests_finished_reason": "finish_reason"}

# vLLM's own definitions (its SpecDecodingLogging): acceptance rate = accepted / drafted tokens;
# mean acceptance length = 1 + accepted / drafts (the bonus token counts); per position
# i: accepted at i / drafts.
RATIOS = (Ratio("prefix_cache_hit_rate", "prefix_cache_hits", "prefix_cache_queries",
                absent_is_zero=True),
          Ratio("spec_acceptance_rate", "spec_accepted_tokens", "spec_draft_tokens"),
          Ratio("spec_mean_accepted_len", "spec_accepted_tokens", "spec_drafts", 1.0),
          Ratio("spec_acceptance_rate_at", "spec_accepted_tokens_at", "spec_drafts"))

# Names as each server's own source defines them: vLLM's V1 metrics; SGLang's
# python/sglang/srt/observability/metrics_collector.py (a scheduler per data-parallel rank labels
# its series with tp_rank/pp_rank, the tokenizer's carry model_name only); TGI's router/src
# (metrics-exporter-prometheus: histograms for names ending in "duration" and for the token
# counts); llama.cpp's tools/server/server-task.cpp (counters and gauges only).
_SG_RANKS = ("tp_rank", "pp_rank")

TABLE: tuple[MetricMap, ...] = (
    # Latency histograms, in seconds.
    _m("ttft_s", "vllm:time_to_first_token_seconds", "histogram"),
    _m("ttft_s", "sglang:time_to_first_token_seconds", "histogram"),
    _m("ttft_s", "trtllm_time_to_first_token_seconds", "histogram"),
    _m("ttft_s", "nv_inference_first_response_histogram_ms", "histogram", 1e-3),
    _m("itl_s", "vllm:inter_token_latency_seconds", "histogram"),
    _m("itl_s", "vllm:time_per_output_token_seconds", "histogram"),
    _m("itl_s", "sglang:inter_token_latency_seconds", "histogram"),
    _m("tpot_s", "vllm:request_time_per_output_token_seconds", "histogram"),
    # SGLang before its inter-token histogram: (now - first token) / (tokens - 1), observed at
    # each streamed chunk: a time per output token, sampled per chunk rather than per request.
    _m("tpot_s", "sglang:time_per_output_token_seconds", "histogram"),
    _m("tpot_s", "tgi_request_mean_time_per_token_duration", "histogram"),
    _m("tpot_s", "trtllm_time_per_output_token_seconds", "histogram"),
    _m("e2e_s", "vllm:e2e_request_latency_seconds", "histogram"),
    _m("e2e_s", "sglang:e2e_request_latency_seconds", "histogram"),
    _m("e2e_s", "tgi_request_duration", "histogram"),
    _m("e2e_s", "trtllm_e2e_request_latency_seconds", "histogram"),
    _m("queue_s", "vllm:request_queue_time_seconds", "histogram"),
    _m("queue_s", "sglang:queue_time_seconds", "histogram", replicas=_SG_RANKS),
    _m("queue_s", "tgi_request_queue_duration", "histogram"),
    _m("queue_s", "trtllm_request_queue_time_seconds", "histogram"),
    _m("prefill_s", "vllm:request_prefill_time_seconds", "histogram"),
    _m("decode_s", "vllm:request_decode_time_seconds", "histogram"),
    _m("inference_s", "vllm:request_inference_time_seconds", "histogram"),
    # Token-count histograms: tokens per engine step and per request.
    _m("iteration_tokens", "vllm:iteration_tokens_total", "histogram"),
    _m("request_prompt_tokens", "vllm:request_prompt_tokens", "histogram"),
    _m("request_generation_tokens", "vllm:request_generation_tokens", "histogram"),
    # Scheduler state.
    _m("requests_running", "vllm:num_requests_running", "gauge"),
    _m("requests_running", "sglang:num_running_reqs", "gauge", replicas=_SG_RANKS),
    _m("requests_running", "tgi_batch_current_size", "gauge"),
    _m("requests_running", "llamacpp:requests_processing", "gauge"),
    _m("requests_running", "trtllm_num_requests_running", "gauge"),
    _m("requests_running", "nv_trt_llm_request_metrics", "gauge",
       labels=(("request_type", "active"),)),
    _m("requests_waiting", "vllm:num_requests_waiting", "gauge"),
    _m("requests_waiting", "sglang:num_queue_reqs", "gauge", replicas=_SG_RANKS),
    _m("requests_waiting", "tgi_queue_size", "gauge"),
    _m("requests_waiting", "llamacpp:requests_deferred", "gauge"),
    _m("requests_waiting", "trtllm_num_requests_waiting", "gauge"),
    _m("requests_waiting", "nv_trt_llm_request_metrics", "gauge",
       labels=(("request_type", "waiting"),)),
    # KV-cache usage as a 0-1 fraction.
    _m("kv_cache_usage", "vllm:kv_cache_usage_perc", "gauge", agg="mean"),
    _m("kv_cache_usage", "vllm:gpu_cache_usage_perc", "gauge", agg="mean"),
    _m("kv_cache_usage", "sglang:token_usage", "gauge", agg="mean", replicas=_SG_RANKS),
    _m("kv_cache_usage", "llamacpp:kv_cache_usage_ratio", "gauge", agg="mean"),
    _m("kv_cache_usage", "trtllm_kv_cache_utilization", "gauge", agg="mean"),
    _m("kv_cache_usage", "nv_trt_llm_kv_cache_block_metrics", "gauge", agg="mean",
       labels=(("kv_cache_block_type", "fraction"),)),
    # Token and request counters, turned into per-second rates.
    _m("prompt_tokens", "vllm:prompt_tokens_total", "counter"),
    _m("prompt_tokens", "sglang:prompt_tokens_total", "counter"),
    _m("prompt_tokens", "tgi_request_input_length_sum", "counter"),
    _m("prompt_tokens", "llamacpp:prompt_tokens_total", "counter",
       also=("llamacpp:prompt_tokens_cached_total",)),
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
    _m("requests_finished_reason", "vllm:request_success_total", "counter",
       per="finished_reason", per_as="reason", values=FINISHED_REASONS),
    _m("preemptions", "vllm:num_preemptions_total", "counter"),
    _m("preemptions", "sglang:num_retracted_requests_total", "counter", replicas=_SG_RANKS),
    # servescope serve's own (engine/serve_metrics.py): KV entries its eviction policies
    # dropped, and requests recomputed alone after a batch step failed.
    _m("kv_evicted_tokens", "servescope:kv_evicted_tokens_total", "counter"),
    _m("isolated_requests", "servescope:engine_isolated_requests_total", "counter"),
    # Prefix cache and speculative decoding (their ratios are derived below, see RATIOS).
    _m("prefix_cache_queries", "vllm:prefix_cache_queries_total", "counter"),
    _m("prefix_cache_hits", "vllm:prefix_cache_hits_total", "counter"),
    # SGLang's cache_hit_rate gauge is not read: its scheduler sets it at each prefill log and
    # back to 0 at each decode log, so between prefills it reads 0. Its token counters (counted
    # as requests finish) give the hit rate over the window instead.
    _m("prefix_cache_queries", "sglang:prompt_tokens_total", "counter"),
    _m("prefix_cache_hits", "sglang:cached_tokens_total", "counter"),
    _m("prefix_cache_queries", "llamacpp:prompt_tokens_total", "counter",
       also=("llamacpp:prompt_tokens_cached_total",)),
    _m("prefix_cache_hits", "llamacpp:prompt_tokens_cached_total", "counter"),
    _m("spec_drafts", "vllm:spec_decode_num_drafts_total", "counter"),
    _m("spec_drafts", "llamacpp:spec_decode_num_drafts_total", "counter"),
    _m("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens_total", "counter"),
    _m("spec_draft_tokens", "llamacpp:spec_decode_num_draft_tokens_total", "counter"),
    _m("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total", "counter"),
    _m("spec_accepted_tokens", "llamacpp:spec_decode_num_accepted_tokens_total", "counter"),
    _m("spec_accepted_tokens_at", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
       "counter", per="position"),
    _m("spec_accepted_tokens_at", "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
       "counter", per="position"),
    # SGLang's own ratios over its last decode-log interval (accept length counts the bonus
    # token, as vLLM's mean acceptance length does); 0 for both when speculation is off.
    _m("spec_acceptance_rate", "sglang:spec_accept_rate", "gauge", agg="mean",
       replicas=_SG_RANKS, only_if="sglang:spec_accept_length"),
    _m("spec_mean_accepted_len", "sglang:spec_accept_length", "gauge", agg="mean",
       replicas=_SG_RANKS, only_if="sglang:spec_accept_length"),
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
    # Single-bit (corrected) volatile ECC errors, and the clock throttle reasons as NVML's bitmask
    # (dcgm_fields.h; off in dcgm-exporter's default counters, the diagnosis reads them if on).
    _m("ecc_corrected", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", per="gpu"),
    _m("throttle_reasons", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", per="gpu"),
)

SERVESCOPE_PREFIX = "servescope:"
KIND_PREFIXES = (("vllm", "vllm:"), ("sglang", "sglang:"), ("tgi", "tgi_"),
                 ("llamacpp", "llamacpp:"), ("trtllm", "trtllm_"), ("triton", "nv_inference_"),
                 ("dcgm", "DCGM_FI_"))


# What the monitor can chart of a server, by the series its metrics feed (the Servers pane's
# "Exposes" column): derived from TABLE, so it says what the normaliser really reads.
EXPOSED_GROUPS = (
    ("latency percentiles", ("ttft_s", "tpot_s", "itl_s", "e2e_s")),
    ("request phases", ("queue_s", "prefill_s", "decode_s", "inference_s")),
    ("running/waiting", ("requests_running", "requests_waiting")),
    ("KV-cache usage", ("kv_cache_usage",)),
    ("tokens/s", ("prompt_tokens", "generation_tokens")),
    ("finish reasons", ("requests_finished_reason",)),
    ("preemptions", ("preemptions",)),
    ("prefix-cache hits", ("prefix_cache_hits",)),
    ("speculative acceptance", ("spec_accepted_tokens", "spec_acceptance_rate")),
    ("KV eviction", ("kv_evicted_tokens",)),
    ("GPU utilization, memory, power", ("gpu_util_pct", "memory_used_bytes", "power_w")),
    ("SM occupancy", ("sm_occupancy_pct",)),
)
# The metric-name prefixes each kind's own exporter uses (Triton's GPU and TRT-LLM backend
# families have prefixes of their own; servescope serve speaks vLLM's names besides its own).
KIND_NAME_PREFIXES = {"servescope": ("vllm:", "servescope:"),
                      "triton": ("nv_inference_", "nv_trt_llm_", "nv_gpu_")}
# Kinds read without Prometheus text: what they give instead.
NOT_PROMETHEUS = {"ollama": "loaded models and their memory (no /metrics)",
                  "openai": "the models it serves (no /metrics): load-test it for latencies",
                  "tabbyapi": "the models it serves (no /metrics): load-test it for latencies",
                  # monitor/promapi.py's default PromQL over vLLM's names, backfilled.
                  "prometheus-api": "the fleet's latency percentiles, running/waiting, KV-cache "
                                    "usage and tokens/s, through PromQL"}


def exposes(kind: str, api_only: bool = False) -> str:
    """What the monitor reads from a server of this kind, in a few words."""
    if api_only or kind in NOT_PROMETHEUS:
        return NOT_PROMETHEUS.get(kind, NOT_PROMETHEUS["openai"])
    prefixes = KIND_NAME_PREFIXES.get(kind) or tuple(p for k, p in KIND_PREFIXES if k == kind)
    if not prefixes:
        return "whatever it exports under names the monitor does not know" \
            if kind == "prometheus" else "—"
    fed = {m.series for m in TABLE if m.remote.startswith(prefixes)}
    fed |= {r.series for r in RATIOS if r.numerator in fed}
    return ", ".join(label for label, series in EXPOSED_GROUPS if fed.intersection(series))


def detect_kind(names: set[str]) -> str:
    """The server kind whose metric prefix most names carry, else "prometheus".

    `servescope serve` speaks vLLM's names (so dashboards work unchanged) plus a few of its
    own namespace, which name it."""
    if any(n.startswith(SERVESCOPE_PREFIX) for n in names):
        return "servescope"
    counts = {kind: sum(1 for n in names if n.startswith(p)) for kind, p in KIND_PREFIXES}
    kind, hits = max(counts.items(), key=lambda kv: kv[1])
    return kind if hits else "prometheus"


def _matching(scrape: Scrape, name: str, want: Labels) -> list[tuple[Labels, float]]:
    rows = scrape.values(name)
    if not rows and not name.endswith("_total"):
        # prometheus_client's parser names a counter's sample NAME_total when its `# TYPE NAME
        # counter` line says counter, whatever the text wrote (TGI's tgi_request_success, Triton's
        # nv_inference_request_success and DCGM's energy counter carry no _total).
        rows = scrape.values(name + "_total")
    return [(labels, v) for labels, v in rows if all(pair in labels for pair in want)]


def _rank(value: str) -> tuple:
    return (0, int(value), "") if value.isdigit() else (1, 0, value)


def _first_replica(rows: list[tuple[Labels, float]], replicas: tuple[str, ...]
                   ) -> list[tuple[Labels, float]]:
    """Of rows that differ only in the replica labels, those of the lowest replica."""
    if not replicas:
        return rows
    best: dict[Labels, tuple] = {}
    for labels, _ in rows:
        d = dict(labels)
        key = tuple(p for p in labels if p[0] not in replicas)
        rank = tuple(_rank(d.get(r, "")) for r in replicas)
        if key not in best or rank < best[key]:
            best[key] = rank
    return [(labels, v) for labels, v in rows
            if tuple(_rank(dict(labels).get(r, "")) for r in replicas)
            == best[tuple(p for p in labels if p[0] not in replicas)]]


def _rows(scrape: Scrape, m: MetricMap, suffix: str = "") -> list[tuple[Labels, float]]:
    """The samples feeding one entry: its family (and `also` families, each told apart by a
    __family__ label so their counters keep separate state), lowest replica only."""
    rows = _matching(scrape, m.remote + suffix, m.labels)
    for name in m.also:
        rows += [(labels + (("__family__", name),), v)
                 for labels, v in _matching(scrape, name + suffix, m.labels)]
    return _first_replica(rows, m.replicas)


def _split(rows: list[tuple[Labels, float]], per: str | None, per_as: str | None = None,
           values: tuple[tuple[str, str], ...] = ()) -> dict[str, list]:
    if per is None:
        return {"": rows}
    rename = dict(values)
    groups: dict[str, list] = {}
    for labels, value in rows:
        raw = dict(labels).get(per, "")
        label = rename.get(raw.lower(), raw) if rename else raw
        groups.setdefault(f"[{per_as or per}={label}]", []).append((labels, value))
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

    def __init__(self, window_s: float = 60.0, drift: OutputDrift | None = None) -> None:
        self.window_s = window_s
        # Response lengths and finish reasons against the source's baseline (monitor/drift.py).
        self.drift = drift if drift is not None else OutputDrift(window_s)
        self._counters: dict[tuple[str, str, Labels], tuple[float, float]] = {}
        self._hist: dict[str, tuple[dict, dict, dict]] = {}
        self._windows: dict[str, deque] = {}
        self._increases: dict[str, deque] = {}  # counter series -> (ts, increase) in window
        self._seen: set[str] = set()  # counter series (with suffix) the last scrape carried
        self._last_scrape: float | None = None

    def update(self, scrape: Scrape, now: float) -> list[tuple[str, float]]:
        """Series values from one scrape taken at `now` (seconds)."""
        out: list[tuple[str, float]] = []
        done: set[str] = set()
        self._seen = set()
        for m in TABLE:
            probe = m.remote + "_bucket" if m.type == "histogram" else m.remote
            if m.series in done or not _matching(scrape, probe, m.labels):
                continue
            if m.only_if and not any(v > 0 for _, v in scrape.values(m.only_if)):
                continue
            done.add(m.series)
            if m.type == "gauge":
                out += self._gauge(m, scrape)
            elif m.type == "counter":
                out += self._counter(m, scrape, now)
            else:
                out += self._histogram(m, scrape, now)
        out += self._ratios(done)
        self._last_scrape = now
        return [(name, v) for name, v in out if math.isfinite(v)]

    def _gauge(self, m: MetricMap, scrape: Scrape) -> list[tuple[str, float]]:
        groups = _split(_rows(scrape, m), m.per, m.per_as, m.values)
        return [(m.series + suffix, _group_total(rows, m.agg) * m.scale)
                for suffix, rows in groups.items()]

    def _counter(self, m: MetricMap, scrape: Scrape, now: float) -> list[tuple[str, float]]:
        out = []
        finished: dict[str, float] = {}  # this scrape's increase per split value
        rows_by = _split(_rows(scrape, m), m.per, m.per_as, m.values)
        for suffix, rows in rows_by.items():
            increase, dt = 0.0, None
            for labels, value in rows:
                prev = self._counters.get((m.series, m.remote, labels))
                if prev is None and self._last_scrape is not None:
                    prev = (self._last_scrape, 0.0)  # born since the last scrape: counts from 0
                self._counters[(m.series, m.remote, labels)] = (now, value)
                if prev is not None and now > prev[0]:
                    increase += counter_delta(prev[1], value)
                    dt = now - prev[0]
            # The running total too: counts over any span are then differences, not integrals.
            out.append((f"{m.series}_total{suffix}", sum(v for _, v in rows) * m.scale))
            self._seen.add(m.series + suffix)
            if dt:
                out.append((f"{m.series}_per_s{suffix}", increase * m.scale / dt))
                self._window(f"{m.series}{suffix}", now, increase * m.scale)
                finished[suffix.strip("[]").split("=", 1)[-1]] = increase * m.scale
        if m.series in DRIFT_COUNTERS and finished:
            out += self.drift.observe(DRIFT_COUNTERS[m.series], finished, now)
        return out

    def _window(self, key: str, now: float, increase: float) -> None:
        window = self._increases.setdefault(key, deque())
        window.append((now, increase))
        while window and window[0][0] <= now - self.window_s:
            window.popleft()

    def _ratios(self, done: set[str]) -> list[tuple[str, float]]:
        """RATIOS over the window, for the counters this scrape carried."""
        out = []
        totals = {k: sum(v for _, v in w) for k, w in self._increases.items()}
        for r in RATIOS:
            if r.series in done:  # the server reports the ratio itself (SGLang's gauges)
                continue
            den = totals.get(r.denominator)
            if not den or r.denominator not in self._seen:
                continue
            if r.absent_is_zero and not any(k == r.numerator or k.startswith(r.numerator + "[")
                                            for k in self._seen):
                out.append((r.series, r.offset))
                continue
            for key, num in totals.items():
                suffix = key[len(r.numerator):]
                if key.startswith(r.numerator) and (suffix == "" or suffix.startswith("[")) \
                        and key in self._seen:
                    out.append((r.series + suffix, r.offset + num / den))
        return out

    def _histogram(self, m: MetricMap, scrape: Scrape, now: float) -> list[tuple[str, float]]:
        buckets: dict[Labels, dict[float, float]] = {}
        for labels, value in _rows(scrape, m, "_bucket"):
            try:
                le = float(dict(labels)["le"])
            except (KeyError, ValueError):
                continue
            buckets.setdefault(_without(labels, "le"), {})[le] = value
        sums = dict(_rows(scrape, m, "_sum"))
        counts = dict(_rows(scrape, m, "_count"))
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
        if m.series in DRIFT_HISTOGRAMS:
            out += self.drift.observe(DRIFT_HISTOGRAMS[m.series], bucket_counts(deltas), now)
        window = self._windows.setdefault(m.remote, deque())
        window.append((now, deltas, dsum, dcount))
        while window and window[0][0] <= now - self.window_s:
            window.popleft()
        merged = sum_by_le(d for _, d, _, _ in window)
        if not merged or merged[-1][1] <= 0:
            return out
        for q in QUANTILES:
            name = f"{m.series}_p{round(q * 100)}"
            lo, hi = quantile_interval(q, merged)
            # The bucket the estimate lies in travels with it: the true quantile is somewhere
            # in (lo, hi], and only there (hi = +Inf is dropped below: unbounded above).
            out += [(name, histogram_quantile(q, merged) * m.scale),
                    (name + "_lo", lo * m.scale), (name + "_hi", hi * m.scale)]
        n = sum(w[3] for w in window)
        if n > 0:
            out.append((f"{m.series}_mean", sum(w[2] for w in window) / n * m.scale))
        return out
