"""Diagnosis: small data-driven rules over stored or live series naming a bottleneck or a cause."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from storage.queries import counter_increase


@dataclass(frozen=True)
class Threshold:
    """A named limit a rule compares a statistic with, and why it sits there."""

    value: float
    why: str


THRESHOLDS: dict[str, Threshold] = {
    "LOW_SM_OCCUPANCY_PCT": Threshold(40.0, "under 40% of the warp slots busy on average: the "
                                      "SMs mostly wait, for memory or for work"),
    "HIGH_SM_OCCUPANCY_PCT": Threshold(70.0, "over 70% of the warp slots busy on average: the "
                                       "SMs are the limit"),
    "HIGH_MEM_BW_PCT": Threshold(60.0, "DRAM busy over 60% of the time (GPM DRAM_BW_UTIL, DCGM "
                                 "DRAM_ACTIVE): decode reading weights and KV near the peak"),
    "LOW_MEM_BW_PCT": Threshold(30.0, "DRAM busy under 30% of the time: memory is not the limit"),
    "SPIKE_RATIO": Threshold(3.0, "the window's highest p99 at least 3x its median p50: the "
                             "tail, not the typical request, got slow"),
    "KV_FULL": Threshold(0.9, "KV-cache usage reached 90%: vLLM preempts when a running "
                         "request needs a block and none is free"),
    "MIN_PREEMPTIONS": Threshold(1.0, "at least one request preempted (its KV freed, to be "
                                 "recomputed) in the window"),
    "LONG_REQUEST_RATIO": Threshold(5.0, "the p99 end-to-end time at least 5x the median: one "
                                    "request in a hundred lasting as long as five typical ones"),
    "THROTTLE_SHARE": Threshold(0.2, "a power or thermal clock-slowdown reason set in at least "
                                "20% of the window's samples (idle and sync-boost do not count)"),
    "MIN_ECC_CORRECTED": Threshold(1.0, "at least one corrected ECC error in the window"),
    "THROUGHPUT_KEPT": Threshold(0.75, "tokens/s in the window's last third at most 75% of its "
                                 "first third: a drop of a quarter or more"),
    "BATCH_KEPT": Threshold(0.75, "tokens per step (or requests running) in the last third at "
                            "most 75% of the first third"),
    "LONGER_SEQUENCES": Threshold(1.25, "mean prompt or output length per request up 25% or "
                                  "more from the first third to the last"),
    "QUEUE_GROWTH": Threshold(2.0, "requests waiting in the last third at least twice the first "
                              "third's"),
    "MIN_WAITING": Threshold(1.0, "at least one request waiting on average in the last third "
                             "(growth from almost nothing is noise)"),
    "MIN_RUNNING": Threshold(1.0, "at least one request running on average in the last third: "
                             "the load is still there"),
    "COST_UP": Threshold(1.2, "cost per 1M tokens in the last third at least 20% above the "
                         "first third's"),
    "THROUGHPUT_NOT_UP": Threshold(1.0, "tokens/s in the last third not above the first third's"),
    "DEMAND_HELD": Threshold(0.9, "requests running in the last third at least 90% of the first "
                             "third's: the same demand"),
}

# NVML's clock-event reasons (nvmlClocksEventReason*) that slow the clocks down; GpuIdle (0x1),
# the applications clock setting (0x2) and SyncBoost (0x10) are not trouble.
THROTTLE_BITS = {0x4: "software power cap", 0x8: "hardware slowdown",
                 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                 0x80: "hardware power brake"}
THROTTLE_MASK = sum(THROTTLE_BITS)


# ---- statistics over a window
def _thirds(ts: np.ndarray, values: np.ndarray, start: float, end: float):
    third = (end - start) / 3.0
    return values[ts <= start + third], values[ts >= end - third]


def _growth(ts, values, start, end) -> float | None:
    first, last = _thirds(ts, values, start, end)
    if not first.size or not last.size:
        return None
    base, recent = float(first.mean()), float(last.mean())
    if base <= 0:
        return math.inf if recent > 0 else None
    return recent / base


def _recent(ts, values, start, end) -> float | None:
    last = _thirds(ts, values, start, end)[1]
    return float(last.mean()) if last.size else None


# Each statistic of a window's (timestamps, values) between start and end; c is the Condition.
STATS = {
    "mean": lambda ts, v, s, e, c: float(v.mean()),
    "max": lambda ts, v, s, e, c: float(v.max()),
    "median": lambda ts, v, s, e, c: float(np.median(v)),
    "recent": lambda ts, v, s, e, c: _recent(ts, v, s, e),
    "increase": lambda ts, v, s, e, c: counter_increase(v) if v.size >= 2 else None,
    "growth": lambda ts, v, s, e, c: _growth(ts, v, s, e),
    "share_bits": lambda ts, v, s, e, c: float(np.mean((v.astype(np.int64) & c.mask) != 0)),
}


@dataclass(frozen=True)
class Condition:
    """One statistic of one series (the first of ``metrics`` present) compared with a named
    threshold; with ``over``, the statistic divided by ``over_stat`` of another series."""

    name: str
    metrics: tuple[str, ...]
    stat: str  # mean, max, median, recent, increase, growth, share_bits
    op: str  # ">=" or "<="
    threshold: str
    over: tuple[str, ...] = ()
    over_stat: str = "median"
    mask: int = 0

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"condition {self.name!r}: op must be >= or <=")
        if self.threshold not in THRESHOLDS:
            raise ValueError(f"condition {self.name!r}: unknown threshold {self.threshold!r}")
        if self.stat not in STATS or (self.over and self.over_stat not in STATS):
            raise ValueError(f"condition {self.name!r}: unknown statistic")


@dataclass(frozen=True)
class Rule:
    """A cause: every ``all`` condition holds, one ``any`` (if given) holds, no ``unless``;
    ``title`` is formatted with the conditions' values (``{name}``, ``{name}_num`` ...)."""

    id: str
    kind: str
    scope: str  # "server" or "gpu"
    title: str
    advice: str
    all: tuple[Condition, ...]
    any: tuple[Condition, ...] = ()
    unless: tuple[Condition, ...] = ()
    context: tuple[str, ...] = ()  # further series shown as evidence where present


def _c(name: str, metrics: str | tuple[str, ...], stat: str, op: str, threshold: str,
       **kw: Any) -> Condition:
    metrics = (metrics,) if isinstance(metrics, str) else metrics
    over = kw.pop("over", ())
    return Condition(name, metrics, stat, op, threshold,
                     over=(over,) if isinstance(over, str) else over, **kw)


_OCCUPANCY = ("sm_occupancy_pct",)  # NVML GPM, or DCGM_FI_PROF_SM_OCCUPANCY x 100
_DRAM = ("dram_bw_util_pct", "dram_active_pct")  # GPM DRAM_BW_UTIL, DCGM_FI_PROF_DRAM_ACTIVE
_TOKENS = ("generation_tokens_per_s", "decode_tokens_per_s")
_PREEMPTED = _c("preemptions", "preemptions_total", "increase", ">=", "MIN_PREEMPTIONS")

RULES: tuple[Rule, ...] = (
    Rule("memory_bound", "bottleneck", "gpu",
         "GPU {gpu} memory-bound: SM occupancy {occupancy:.0f}% with memory bandwidth {dram:.0f}%",
         "Move fewer bytes per token: quantize the weights (int8/fp8/int4) and the KV cache "
         "(fp8), batch more requests per step (raise max-num-seqs) so each weight read serves "
         "more tokens, or use a GPU with more memory bandwidth.",
         (_c("occupancy", _OCCUPANCY, "mean", "<=", "LOW_SM_OCCUPANCY_PCT"),
          _c("dram", _DRAM, "mean", ">=", "HIGH_MEM_BW_PCT")),
         context=("tensor_util_pct", "tensor_active_pct", "sm_util_pct", "sm_active_pct")),
    Rule("compute_bound", "bottleneck", "gpu",
         "GPU {gpu} compute-bound: SM occupancy {occupancy:.0f}% with memory bandwidth "
         "{dram:.0f}%",
         "The SMs are the limit: use FP8 tensor cores or a GPU with more FLOPs, split the model "
         "with tensor parallelism, or cap the batch (max-num-batched-tokens) where latency "
         "matters more than throughput.",
         (_c("occupancy", _OCCUPANCY, "mean", ">=", "HIGH_SM_OCCUPANCY_PCT"),
          _c("dram", _DRAM, "mean", "<=", "LOW_MEM_BW_PCT")),
         context=("tensor_util_pct", "tensor_active_pct", "sm_util_pct", "sm_active_pct")),
    Rule("kv_pressure", "p99 spike", "server",
         "p99 TTFT spike with KV cache full and {preemptions:.0f} preemptions (p99 TTFT up to "
         "{ttft_spike_num:.3g} s{ttft_spike_between}, {ttft_spike:.0f}x the median p50; KV "
         "cache at "
         "{kv_usage:.0%})",
         "KV-cache pressure (thrashing): preempted requests are recomputed and new ones wait "
         "for blocks. Give the KV cache more memory (--gpu-memory-utilization; on CPU "
         "VLLM_CPU_KVCACHE_SPACE), lower --max-num-seqs or --max-model-len, quantize the KV "
         "cache (--kv-cache-dtype fp8), or add a replica.",
         (_c("ttft_spike", "ttft_s_p99", "max", ">=", "SPIKE_RATIO", over="ttft_s_p50"),
          _c("kv_usage", "kv_cache_usage", "max", ">=", "KV_FULL"), _PREEMPTED),
         context=("requests_waiting", "requests_running")),
    Rule("long_request", "p99 spike", "server",
         "a long request monopolising the batch: p99 end-to-end {long:.1f}x the median "
         "({long_num:.3g} s against {long_den:.3g} s)",
         "One request far longer than the rest holds the batch (its prefill chunks and decode "
         "steps slow everyone's): cap max_tokens and prompt length per request, lower "
         "--max-num-batched-tokens so its prefill chunks are smaller, or route long requests "
         "to a server of their own.",
         (_c("long", "e2e_s_p99", "max", ">=", "LONG_REQUEST_RATIO", over="e2e_s_p50"),),
         any=(_c("ttft_spike", "ttft_s_p99", "max", ">=", "SPIKE_RATIO", over="ttft_s_p50"),
              _c("itl_spike", "itl_s_p99", "max", ">=", "SPIKE_RATIO", over="itl_s_p50"),
              _c("tpot_spike", "tpot_s_p99", "max", ">=", "SPIKE_RATIO", over="tpot_s_p50")),
         unless=(_PREEMPTED,),
         context=("request_prompt_tokens_p99", "request_generation_tokens_p99",
                  "requests_running", "requests_waiting")),
    Rule("gpu_throttling", "hardware", "gpu",
         "GPU {gpu} clocks throttled ({throttle_reasons}) in {throttle:.0%} of the window",
         "Thermal: check cooling, airflow and fan curves, and the GPU's temperature against its "
         "slowdown limit. Power: the board hits its power cap; raise it (nvidia-smi -pl) if "
         "the supply allows, or accept lower clocks. Either slows every step, so p99s rise.",
         (_c("throttle", "throttle_reasons", "share_bits", ">=", "THROTTLE_SHARE",
             mask=THROTTLE_MASK),),
         context=("sm_clock_mhz", "temperature_c", "power_w", "power_limit_w")),
    Rule("ecc_corrections", "hardware", "gpu",
         "GPU {gpu} corrected {ecc:.0f} ECC errors in the window",
         "A GPU correcting memory errors runs slower and may be failing: read nvidia-smi -q "
         "-d ECC,ROW_REMAPPER, drain it and reset it, and replace it if the count keeps rising.",
         (_c("ecc", "ecc_corrected_total", "increase", ">=", "MIN_ECC_CORRECTED"),),
         context=("sm_clock_mhz", "temperature_c")),
    Rule("throughput_drop_batch", "throughput drop", "server",
         "throughput drop from lower batch efficiency: tokens/s at {throughput:.0%} of the "
         "window's start, tokens per step at {batch:.0%}, with requests waiting",
         "The server batches fewer requests although work waits: check the KV-cache usage "
         "(full: more KV memory), --max-num-seqs and --max-num-batched-tokens.",
         (_c("throughput", _TOKENS, "growth", "<=", "THROUGHPUT_KEPT"),
          _c("batch", ("iteration_tokens_mean", "requests_running"), "growth", "<=",
             "BATCH_KEPT"),
          _c("waiting", "requests_waiting", "recent", ">=", "MIN_WAITING")),
         context=("kv_cache_usage",)),
    Rule("throughput_drop_longer", "throughput drop", "server",
         "throughput drop from longer sequences: tokens/s at {throughput:.0%} of the window's "
         "start while requests grew longer",
         "Longer prompts and outputs make every step read more KV: expect fewer tokens/s; cap "
         "lengths, enable prefix caching for shared prefixes, or plan capacity for the new "
         "lengths.",
         (_c("throughput", _TOKENS, "growth", "<=", "THROUGHPUT_KEPT"),
          _c("running", "requests_running", "recent", ">=", "MIN_RUNNING")),
         any=(_c("prompts", "request_prompt_tokens_mean", "growth", ">=", "LONGER_SEQUENCES"),
              _c("outputs", "request_generation_tokens_mean", "growth", ">=",
                 "LONGER_SEQUENCES"))),
    Rule("queue_growth", "p99 spike", "server",
         "queue growing: {waiting_recent:.1f} requests waiting on average, up from "
         "{waiting_baseline:.1f}",
         "Demand is above what the server can start: add replicas (autoscale on "
         "vllm:num_requests_waiting), raise --max-num-seqs if the KV cache has room, or shed "
         "load.",
         (_c("waiting", "requests_waiting", "growth", ">=", "QUEUE_GROWTH"),
          _c("waiting_now", "requests_waiting", "recent", ">=", "MIN_WAITING")),
         context=("queue_s_p99", "requests_running", "kv_cache_usage")),
    Rule("efficiency_regression", "cost", "server",
         "efficiency regression: cost per 1M tokens up {cost_change:+.0%} without throughput up, "
         "under the same demand",
         "The same load costs more per token: compare the server's configuration and version "
         "with the window's start (batch limits, precision, speculative decoding off, a slower "
         "GPU or a throttled one).",
         (_c("cost", "usd_per_1m_tokens", "growth", ">=", "COST_UP"),
          _c("throughput", _TOKENS, "growth", "<=", "THROUGHPUT_NOT_UP"),
          _c("demand", "requests_running", "growth", ">=", "DEMAND_HELD"))),
)


class SeriesView(Protocol):
    """Where the rules read series: stored, live or recorded."""

    def keys(self) -> list[str]: ...

    def window(self, key: str, start: float, end: float) -> tuple[np.ndarray, np.ndarray]: ...


class RecordedSeries:
    """Series held in memory: key -> (timestamps, values)."""

    def __init__(self, data: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.data = data

    @classmethod
    def from_json(cls, series: dict[str, list[list[float]]]) -> RecordedSeries:
        """From {key: [[ts, value], ...]} (benchmarks/diagnosis_vllm_kv.py's fixture)."""
        out = {}
        for key, points in series.items():
            arr = np.asarray(points, dtype=float).reshape(-1, 2)
            out[key] = (arr[:, 0], arr[:, 1])
        return cls(out)

    def keys(self) -> list[str]:
        return sorted(self.data)

    def window(self, key: str, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        ts, values = self.data.get(key, (np.empty(0), np.empty(0)))
        keep = (ts >= start) & (ts <= end)
        return ts[keep], values[keep]

    def span(self) -> tuple[float, float]:
        """The first and last timestamp of any series."""
        stamps = [ts for ts, _ in self.data.values() if len(ts)]
        if not stamps:
            raise ValueError("the recording holds no samples")
        return min(float(t[0]) for t in stamps), max(float(t[-1]) for t in stamps)


class HubSeries:
    """A hub's live ring buffers (monitor.hub.Hub)."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub

    def keys(self) -> list[str]:
        return self.hub.series_keys()

    def window(self, key: str, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        ts, values = self.hub.series(key, since=start)
        keep = ts <= end
        return ts[keep], values[keep]


class StoredSeries:
    """A database's stored series (storage.queries), optionally of one source."""

    def __init__(self, db: Any, source: str | None = None) -> None:
        self.db, self.source = db, source

    def keys(self) -> list[str]:
        from storage.queries import list_series

        keys = list_series(self.db)
        if self.source is None:
            return keys
        return [k for k in keys if subject_of(k)[0] == self.source]

    def window(self, key: str, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        from storage.queries import series_window

        return series_window(self.db, key, start, end)


# ---- subjects: a server, or one GPU of a source
_GPU_PREFIX = re.compile(r"^(\d+)/(.+)$")
_GPU_LABEL = re.compile(r"^(.+)\[(?:gpu|gpu_uuid)=([^\]]+)\]$")


def subject_of(key: str) -> tuple[str, str, str]:
    """(source, gpu, metric) of a series key: "gpu/0/power_w" -> ("gpu", "0", "power_w"),
    "dcgm/power_w[gpu=1]" -> ("dcgm", "1", "power_w"); a cost source joins its server."""
    source, _, metric = key.partition("/")
    source = source.removesuffix("-cost")
    m = _GPU_PREFIX.match(metric)
    if m:
        return source, m.group(1), m.group(2)
    m = _GPU_LABEL.match(metric)
    if m:
        return source, m.group(2), m.group(1)
    return source, "", metric


@dataclass(frozen=True)
class Evidence:
    """What a condition read: the series, the window, the statistic and the values."""

    series: str
    stat: str
    value: float | None  # None: a growth from zero
    start: float
    end: float
    threshold: str | None = None
    limit: float | None = None
    over: str | None = None
    summary: dict[str, float] = field(default_factory=dict)
    # A histogram quantile's bucket (lower, upper; upper None = unbounded) where the value was
    # read: the true quantile lies there, the estimate is only an interpolation.
    bucket: tuple[float, float | None] | None = None

    def sentence(self) -> str:
        what = f"{self.stat} of {self.series}" + (f" / median of {self.over}" if self.over else "")
        shown = "a rise from 0" if self.value is None else _num(self.value)
        text = f"{what} over {self.end - self.start:.0f} s is {shown}"
        if self.bucket is not None and self.over is None:
            text += f" ({between(*self.bucket)})"
        if self.threshold:
            text += f" (limit {self.threshold} = {_num(self.limit)})"
        return text


@dataclass(frozen=True)
class Verdict:
    """A named cause on one server or GPU over a window, with its evidence and what to try."""

    rule: str
    kind: str
    source: str
    gpu: str
    title: str
    advice: str
    start: float
    end: float
    evidence: tuple[Evidence, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        evidence = tuple(Evidence(**e) for e in d["evidence"])
        return cls(**{**d, "evidence": evidence})


@dataclass
class Diagnosis:
    """One evaluation: its window, the verdicts, and the rules no subject had the series for."""

    start: float
    end: float
    series: int
    verdicts: list[Verdict]
    not_evaluated: dict[str, list[str]]  # rule id -> the series names it lacked everywhere

    def summary(self) -> str:
        """One sentence: what was found, or that nothing was and what could not be judged."""
        if self.verdicts:
            return "; ".join(f"{v.source}{'/' + v.gpu if v.gpu else ''}: {v.title}"
                             for v in self.verdicts)
        text = (f"No rule's conditions held over {self.end - self.start:.0f} s of "
                f"{self.series} series")
        if self.not_evaluated:
            text += "; not judged for want of series: " + ", ".join(
                f"{rule} ({' or '.join(missing)})" for rule, missing in self.not_evaluated.items())
        return text + "."


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def between(lo: float, hi: float | None) -> str:
    """A histogram bucket as words: "between 0.1 and 0.25", "above 20"."""
    return f"above {_num(lo)}" if hi is None else f"between {_num(lo)} and {_num(hi)}"


_QUANTILE = re.compile(r"_p\d+$")


def _summary(values: np.ndarray) -> dict[str, float]:
    return {"n": int(values.size), "min": float(values.min()), "mean": float(values.mean()),
            "max": float(values.max()), "first": float(values[0]), "last": float(values[-1])}


class _Subject:
    """The series of one server or GPU, read once per window."""

    def __init__(self, view: SeriesView, keys: dict[str, str], start: float, end: float):
        self.view, self.keys, self.start, self.end = view, keys, start, end
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def key(self, metrics: tuple[str, ...]) -> str | None:
        return next((self.keys[m] for m in metrics if m in self.keys), None)

    def read(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        if key not in self._cache:
            ts, values = self.view.window(key, self.start, self.end)
            finite = np.isfinite(values)
            self._cache[key] = (np.asarray(ts)[finite], np.asarray(values)[finite])
        return self._cache[key]

    def stat(self, key: str, stat: str, cond: Condition) -> float | None:
        ts, values = self.read(key)
        if not values.size:
            return None
        return STATS[stat](ts, values, self.start, self.end, cond)


def _judge(subject: _Subject, cond: Condition) -> tuple[bool, Evidence | None, dict] | None:
    """(holds, evidence, title values), or None when the subject lacks the series."""
    key = subject.key(cond.metrics)
    over = subject.key(cond.over) if cond.over else None
    if key is None or (cond.over and over is None):
        return None
    value = subject.stat(key, cond.stat, cond)
    fields: dict[str, Any] = {}
    if over is not None and value is not None:
        den = subject.stat(over, cond.over_stat, cond)
        fields = {f"{cond.name}_num": value, f"{cond.name}_den": den}
        value = value / den if den and den > 0 else None
    if value is None:
        return False, None, fields
    limit = THRESHOLDS[cond.threshold].value
    holds = value >= limit if cond.op == ">=" else value <= limit
    ts, values = subject.read(key)
    fields[cond.name] = value
    if cond.stat == "growth":
        first, last = _thirds(ts, values, subject.start, subject.end)
        fields.update({f"{cond.name}_baseline": float(first.mean()),
                       f"{cond.name}_recent": float(last.mean()),
                       f"{cond.name}_change": value - 1})
    if cond.stat == "share_bits":
        seen = int(np.bitwise_or.reduce(values.astype(np.int64)))
        fields[f"{cond.name}_reasons"] = ", ".join(n for b, n in THROTTLE_BITS.items()
                                                    if seen & b & cond.mask) or "none"
    bucket = _bucket_at_max(subject, key) if cond.stat == "max" else None
    if cond.stat == "max":
        unit = " s" if "_s_p" in key else ""  # latencies are stored in seconds
        fields[f"{cond.name}_between"] = f", {between(*bucket)}{unit}" if bucket else ""
    # A growth from nothing is infinite: held, but stored as no number (JSON has no Infinity).
    shown = value if math.isfinite(value) else None
    evidence = Evidence(key, cond.stat, shown, subject.start, subject.end, cond.threshold, limit,
                        over, _summary(values), bucket)
    return holds, evidence, fields


def _bucket_at_max(subject: _Subject, key: str) -> tuple[float, float | None] | None:
    """The bucket stored with a histogram quantile's highest reading (monitor.normalize writes
    ``key_lo`` and, unless unbounded, ``key_hi`` in the same scrape); None for exact series."""
    if not _QUANTILE.search(key):
        return None
    ts, values = subject.read(key)
    at = ts[int(np.argmax(values))]
    lo_ts, lo = subject.read(key + "_lo")
    hit = np.flatnonzero(lo_ts == at)
    if not hit.size:
        return None
    hi_ts, hi = subject.read(key + "_hi")
    hi_hit = np.flatnonzero(hi_ts == at)
    return float(lo[hit[0]]), (float(hi[hi_hit[0]]) if hi_hit.size else None)


def _context(subject: _Subject, rule: Rule) -> list[Evidence]:
    out = []
    for metric in rule.context:
        key = subject.key((metric,))
        if key is not None and subject.read(key)[1].size:
            values = subject.read(key)[1]
            out.append(Evidence(key, "max", float(values.max()), subject.start, subject.end,
                                summary=_summary(values)))
    return out


def apply_rule(rule: Rule, subject: _Subject, source: str, gpu: str
               ) -> tuple[Verdict | None, list[str]]:
    """The rule's verdict on one subject (or None), and the series it lacked."""
    evidence: list[Evidence] = []
    fields: dict[str, Any] = {"source": source, "gpu": gpu}
    for cond in rule.all:
        judged = _judge(subject, cond)
        if judged is None:
            return None, list(cond.metrics)
        holds, ev, values = judged
        if not holds:
            return None, []
        evidence.append(ev)
        fields.update(values)
    if rule.any:
        judged_any = [j for j in (_judge(subject, c) for c in rule.any) if j is not None]
        if not judged_any:
            return None, [m for c in rule.any for m in c.metrics]
        held = [j for j in judged_any if j[0]]
        if not held:
            return None, []
        for _, ev, values in held:
            evidence.append(ev)
            fields.update(values)
    for cond in rule.unless:
        judged = _judge(subject, cond)
        if judged is not None and judged[0]:
            return None, []
    title = rule.title.format(**fields)
    return Verdict(rule.id, rule.kind, source, gpu, title, rule.advice, subject.start,
                   subject.end, tuple(evidence + _context(subject, rule))), []


def wanted_metrics(rules: Iterable[Rule] = RULES) -> set[str]:
    """The series names (metric part) the rules read."""
    names = set()
    for rule in rules:
        for cond in (*rule.all, *rule.any, *rule.unless):
            names.update(cond.metrics + cond.over)
        names.update(rule.context)
    return names


def evaluate(view: SeriesView, start: float, end: float,
             rules: Iterable[Rule] = RULES) -> Diagnosis:
    """Every rule on every server and GPU the view holds series of, over [start, end]."""
    if end <= start:
        raise ValueError("the diagnosis window must end after it starts")
    rules = tuple(rules)
    wanted = wanted_metrics(rules)
    all_keys = view.keys()
    subjects: dict[tuple[str, str], dict[str, str]] = {}
    for key in all_keys:
        source, gpu, metric = subject_of(key)
        if metric in wanted:
            subjects.setdefault((source, gpu), {})[metric] = key
    verdicts, missing = [], {}
    for rule in rules:
        judged, lacked = False, sorted({m for c in rule.all for m in c.metrics})
        for (source, gpu), keys in sorted(subjects.items()):
            if (rule.scope == "gpu") != bool(gpu):
                continue
            verdict, lacks = apply_rule(rule, _Subject(view, keys, start, end), source, gpu)
            if verdict is not None:
                verdicts.append(verdict)
            judged, lacked = (judged, lacks) if lacks else (True, lacked)
        if not judged:
            missing[rule.id] = lacked
    return Diagnosis(start, end, len(all_keys), verdicts, missing)


def diagnose(view: SeriesView, start: float, end: float,
             rules: Iterable[Rule] = RULES) -> list[Verdict]:
    """The verdicts of `evaluate`."""
    return evaluate(view, start, end, rules).verdicts


# ---- export
CSV_COLUMNS = ("rule", "kind", "source", "gpu", "title", "start_s", "end_s", "evidence",
               "advice")


def verdict_rows(verdicts: Iterable[dict[str, Any]]) -> list[list[str]]:
    """Table rows (CSV_COLUMNS) of verdicts as dicts (Verdict.to_dict or stored rows)."""
    rows = []
    for v in verdicts:
        evidence = "; ".join(Evidence(**e).sentence() for e in v["evidence"])
        rows.append([v["rule"], v["kind"], v["source"], v["gpu"], v["title"],
                     f"{v['start']:.3f}", f"{v['end']:.3f}", evidence, v["advice"]])
    return rows


def verdicts_csv(verdicts: Iterable[dict[str, Any]]) -> str:
    """CSV text: one row per verdict, its evidence as sentences."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    writer.writerows(verdict_rows(verdicts))
    return out.getvalue()


def verdicts_json(verdicts: Iterable[dict[str, Any]]) -> str:
    """JSON text: a list of verdicts with their whole evidence."""
    return json.dumps(list(verdicts), indent=1)
