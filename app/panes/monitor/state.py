"""Plain-Python state of the monitor panes: chart definitions, windows, server entries, CSV."""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

# (label, seconds): the live ring buffers cover the short windows, the database the long ones.
WINDOWS: tuple[tuple[str, float], ...] = (
    ("1 min", 60.0), ("5 min", 300.0), ("15 min", 900.0), ("1 hour", 3600.0),
    ("6 hours", 6 * 3600.0), ("24 hours", 86400.0), ("7 days", 7 * 86400.0))
# Up to this span the hub's ring buffers hold everything (36k points at 1 Hz is 10 hours,
# but a server polled faster fills them sooner, so the database takes over early).
LIVE_ONLY_S = 900.0
DEFAULT_SLO_TTFT_MS = 500.0
DEFAULT_SLO_TPOT_MS = 100.0


@dataclass(frozen=True)
class ChartSpec:
    """One chart: which series (by metric-name pattern) it draws, their scale and its SLO."""

    chart_id: str
    title: str
    unit: str
    patterns: tuple[str, ...]  # regexes on the metric part of "source/metric"; first match wins
    scale: float = 1.0
    slo: str | None = None  # "ttft" or "tpot": draw that SLO as a horizontal line


CHARTS: tuple[ChartSpec, ...] = (
    # GPM occupancy where the GPU has it, otherwise NVML utilization (the title says which).
    ChartSpec("sm", "SM occupancy / GPU utilization", "%",
              (r"(\d+/)?sm_occupancy_pct(\[.*\])?", r"(\d+/)?util_pct",
               r"gpu_util_pct(\[.*\])?")),
    # Ollama reports only the GPU memory its loaded models hold (/api/ps size_vram).
    ChartSpec("memory", "GPU memory used", "GiB",
              (r"(\d+/)?memory_used_bytes(\[.*\])?", r"model_vram_bytes"), scale=1 / 2**30),
    ChartSpec("power", "GPU power", "W", (r"(\d+/)?power_w(\[.*\])?",)),
    ChartSpec("ttft", "TTFT p50 / p95 / p99", "ms", (r"ttft_s_p(50|95|99)",), 1000.0, "ttft"),
    # Servers without a TPOT histogram (ours, llama.cpp) export inter-token latency instead.
    ChartSpec("tpot", "TPOT (or ITL) p50 / p95 / p99", "ms",
              (r"tpot_s_p(50|95|99)", r"itl_s_p(50|95|99)"), 1000.0, "tpot"),
    ChartSpec("itl", "Inter-token latency p50 / p95 / p99", "ms", (r"itl_s_p(50|95|99)",),
              1000.0),
    ChartSpec("e2e", "End-to-end latency p50 / p95 / p99", "ms", (r"e2e_s_p(50|95|99)",),
              1000.0),
    ChartSpec("tokens", "Tokens/s", "tok/s",
              (r"generation_tokens_per_s", r"prompt_tokens_per_s", r"decode_tokens_per_s")),
    ChartSpec("queue", "Running / waiting requests", "requests",
              (r"requests_running", r"requests_waiting")),
    ChartSpec("kv", "KV-cache usage", "%", (r"kv_cache_usage",), 100.0),
    ChartSpec("cost", "Cost per 1M tokens", "$", (r"usd_per_1m_tokens",)),
    # What vLLM says of itself beyond the latencies (monitor.normalize's derived series).
    ChartSpec("cache", "Prefix-cache hit rate / spec acceptance", "%",
              (r"(prefix_cache_hit_rate|spec_acceptance_rate)",), 100.0),
    ChartSpec("phases", "Queue / prefill / decode / inference time p99", "ms",
              (r"(queue|prefill|decode|inference)_s_p99",), 1000.0),
    # Speculative decoding as vLLM defines it (monitor.normalize.RATIOS): acceptance at each
    # draft position, and tokens gained per verification step (the bonus token counts).
    ChartSpec("spec_pos", "Spec acceptance by draft position", "%",
              (r"spec_acceptance_rate_at\[.*\]",), 100.0),
    ChartSpec("spec_len", "Spec mean accepted length (tokens per step)", "tokens",
              (r"spec_mean_accepted_len",)),
    # The batch and the requests' sizes: tokens per engine step, prompt and output per request.
    ChartSpec("sizes", "Tokens per step / prompt / output p50", "tokens",
              (r"(iteration_tokens|request_prompt_tokens|request_generation_tokens)_p50",)),
    ChartSpec("events", "Preemptions / finished requests by reason / steps recomputed", "/s",
              (r"(preemptions_per_s|requests_finished_reason_per_s\[.*\]"
               r"|isolated_requests_per_s)",)),
    # A server's quality canary (Servers → Edit): perplexity on the bundled held-out text.
    ChartSpec("quality", "Quality canary: held-out perplexity", "ppl", (r"canary_perplexity",)),
    # Response lengths and finish reasons against the server's first requests (monitor.drift).
    ChartSpec("drift", "Output drift: response lengths / finish reasons (PSI)", "PSI",
              (r"(response_length|finish_reason)_psi",)),
)


def source_of(key: str) -> str:
    """The source part of a series key; a cost source "x-cost" belongs to server "x"."""
    source = key.split("/", 1)[0]
    return source.removesuffix("-cost")


def chart_series(spec: ChartSpec, keys: Iterable[str], source: str | None = None) -> list[str]:
    """The series a chart draws: per source, every key matching its first pattern that matches."""
    by_source: dict[str, list[str]] = {}
    for key in sorted(keys):
        if "/" in key and (source is None or source_of(key) == source):
            by_source.setdefault(key.split("/", 1)[0], []).append(key)
    out: list[str] = []
    for src_keys in by_source.values():
        for pattern in spec.patterns:
            rx = re.compile(pattern)
            hits = [k for k in src_keys if rx.fullmatch(k.split("/", 1)[1])]
            if hits:
                out += hits
                break
    return out


def band_keys(drawn: Iterable[str], keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """The bucket interval behind each drawn histogram p99 (``x_p99`` -> (``x_p99_lo``,
    ``x_p99_hi``)) where both ends are stored; the last bucket has no upper end, and no band."""
    have = set(keys)
    return {k: (f"{k}_lo", f"{k}_hi") for k in drawn
            if k.endswith("_p99") and f"{k}_lo" in have and f"{k}_hi" in have}


def aligned(lo: tuple[np.ndarray, np.ndarray], hi: tuple[np.ndarray, np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ts, lo, hi) at the timestamps both ends share (one scrape stores both)."""
    ts, i, j = np.intersect1d(lo[0], hi[0], assume_unique=True, return_indices=True)
    return ts, lo[1][i], hi[1][j]


def merge_history(db_ts: np.ndarray, db_values: np.ndarray, live_ts: np.ndarray,
                  live_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stored points older than the live buffer, then the live points (no overlap, in order)."""
    if len(live_ts):
        keep = db_ts < live_ts[0]
        db_ts, db_values = db_ts[keep], db_values[keep]
    return np.concatenate((db_ts, live_ts)), np.concatenate((db_values, live_values))


# A chart keeps its y range while the data fills at least this share of it, so the axis (and
# its cached grid) is not redrawn every frame; the next "nice" range always fills over 40%.
Y_MIN_FILL = 0.3
Y_HEADROOM = 1.05


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k at or above ``x`` (``x`` > 0)."""
    exponent = math.floor(math.log10(x))
    for mantissa in (1.0, 2.0, 5.0, 10.0):
        top = mantissa * 10.0**exponent
        if top >= x * (1 - 1e-12):
            return top
    return 10.0 ** (exponent + 1)


def stable_y_range(visible: Iterable[np.ndarray],
                   current: tuple[float, float] | None) -> tuple[float, float]:
    """A y range holding every finite value in ``visible``: ``current`` while it still fits well,
    else a new one from 0 (or a nice floor below 0) to a nice ceiling with a little headroom."""
    finite = [v[np.isfinite(v)] for v in visible]
    finite = [v for v in finite if v.size]
    if not finite:
        return current or (0.0, 1.0)
    lo = min(0.0, min(float(v.min()) for v in finite))
    hi = max(0.0, max(float(v.max()) for v in finite))
    if current is not None:
        span = current[1] - current[0]
        if current[0] <= lo and hi <= current[1] and (hi - lo) >= Y_MIN_FILL * span:
            return current
    top = nice_ceiling(hi * Y_HEADROOM) if hi > 0 else (0.0 if lo < 0 else 1.0)
    bottom = -nice_ceiling(-lo * Y_HEADROOM) if lo < 0 else 0.0
    return bottom, top


def decimate_peaks(ts: np.ndarray, values: np.ndarray,
                   max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points keeping every peak: the series cut into max_points / 2
    runs of equal length, each drawn as its minimum and maximum (pyqtgraph's "peak" mode)."""
    n = len(ts)
    if n <= max_points:
        return ts, values
    size = -(-n // (max_points // 2))  # points per run, rounded up
    bins = -(-n // size)  # so every run holds a point; the last may be shorter
    pad = bins * size - n
    # NaN marks gaps; fmin/fmax skip them unless a whole run is NaN (then the gap stays).
    padded = np.concatenate((values, np.full(pad, np.nan))).reshape(bins, size)
    lo, hi = np.fmin.reduce(padded, axis=1), np.fmax.reduce(padded, axis=1)
    starts = ts[np.arange(bins) * size]
    ends = ts[np.minimum(np.arange(bins) * size + size - 1, n - 1)]
    out_ts = np.column_stack((starts, ends)).ravel()
    out_values = np.column_stack((lo, hi)).ravel()
    return out_ts, out_values


def series_csv(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> str:
    """Long-format CSV (series, unix time, value) of a chart's data."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["series", "ts_s", "value"])
    for key, (ts, values) in data.items():
        writer.writerows((key, f"{t:.3f}", repr(float(v))) for t, v in zip(ts, values,
                                                                           strict=True))
    return out.getvalue()


def table_csv(header: list[str], rows: Iterable[Iterable[object]]) -> str:
    """A header and rows as CSV text."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


# How a server is read: its own /metrics (any kind, detected), or a Prometheus server's HTTP API.
API_METRICS, API_PROMETHEUS = "metrics", "prometheus"
# The sources table's kind column holds this for Prometheus-API entries (plus " job=NAME").
PROMETHEUS_API_KIND = "prometheus-api"


def canary_source_name(server: str) -> str:
    """The hub source that scores a server's quality canary (its series: NAME-canary/...)."""
    return f"{server}-canary"


@dataclass(frozen=True)
class ServerEntry:
    """A remote server the user added: the token is only a reference (env:NAME), never its value.
    ``api`` says how it is read; ``job`` narrows a Prometheus server's queries to one job;
    ``canary_every_s``, where set, scores the bundled held-out text on it that often (the
    quality canary, monitor/canary.py), by decoding from token ``canary_decode_from`` on
    where that is set (so the score shows what KV eviction or quantization costs)."""

    name: str
    url: str
    token_ref: str = ""
    dollars_per_hour: float | None = None
    api: str = API_METRICS
    job: str = ""
    canary_every_s: float | None = None
    canary_decode_from: int | None = None

    def __post_init__(self) -> None:
        from monitor.promapi import default_queries
        from monitor.remote import ServerConfig

        ServerConfig(self.name, self.url)  # validates the name and URL with the source's rules
        if self.token_ref and not self.token_ref.startswith("env:"):
            raise ValueError("the token must be a reference like env:MY_TOKEN, not the token "
                             "itself, so it is never written to disk")
        if self.dollars_per_hour is not None and self.dollars_per_hour < 0:
            raise ValueError("the hourly price cannot be negative")
        if self.api not in (API_METRICS, API_PROMETHEUS):
            raise ValueError(f"unknown way to read a server {self.api!r}; use "
                             f"{API_METRICS!r} or {API_PROMETHEUS!r}")
        if self.job and self.api != API_PROMETHEUS:
            raise ValueError("a job applies only to a Prometheus server's API")
        default_queries(self.job)  # validates the job name
        if self.canary_every_s is not None:
            self._check_canary()
        elif self.canary_decode_from is not None:
            raise ValueError("scoring by decoding is a way of running the quality canary: "
                             "set the canary's interval too")

    def _check_canary(self) -> None:
        from monitor.ssh import is_ssh_url

        if not self.canary_every_s > 0:
            raise ValueError("the quality canary's interval must be positive (or off)")
        if self.canary_decode_from is not None and self.canary_decode_from < 1:
            raise ValueError("the canary decodes from a token index of at least 1 (or off)")
        if self.api == API_PROMETHEUS:
            raise ValueError("a quality canary scores text on the inference server itself: "
                             "add that server's own URL, not a Prometheus server's")
        if is_ssh_url(self.url):
            raise ValueError("a quality canary cannot reach a server over ssh:// yet: forward "
                             "its port yourself (ssh -L) and add it as http://127.0.0.1:PORT")

    @property
    def canary_name(self) -> str:
        return canary_source_name(self.name)

    @property
    def stored_kind(self) -> str:
        """What the database's sources.kind column holds for this entry."""
        if self.api != API_PROMETHEUS:
            return API_METRICS
        return f"{PROMETHEUS_API_KIND} job={self.job}" if self.job else PROMETHEUS_API_KIND

    @classmethod
    def from_stored(cls, name: str, url: str, token_ref: str | None, price: float | None,
                    kind: str | None, canary_every_s: float | None = None,
                    canary_decode_from: int | None = None) -> ServerEntry:
        """The entry a sources row describes (rows saved before ``api`` existed read /metrics)."""
        kind = kind or ""
        canary = {"canary_every_s": canary_every_s, "canary_decode_from": canary_decode_from}
        if not kind.startswith(PROMETHEUS_API_KIND):
            return cls(name, url, token_ref or "", price, **canary)
        job = kind.removeprefix(PROMETHEUS_API_KIND).strip().removeprefix("job=")
        return cls(name, url, token_ref or "", price, API_PROMETHEUS, job, **canary)


def fmt(value: object, digits: int = 4) -> str:
    """A number for a table cell; a dash when missing."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)
