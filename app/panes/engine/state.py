"""Plain-Python state of the Engine pane: requests, chat, reply figures, stream buffers."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.engine_config import EngineConfig


@dataclass(frozen=True)
class LoadRequest:
    """What the load controls say: the model, its options, and the context and concurrency the
    KV cache is sized for (engine.engine_config sizes it, by the engine's own rules)."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    context_tokens: int = 2048
    concurrency: int = 4
    speculative: str = "off"
    prefix_caching: bool = False
    kv_policy: str = "none"
    kv_budget: int | float | None = None  # tokens, or a fraction of each request's length
    weights: str = "float"
    kv_cache_dtype: str = "auto"  # or int8 / fp8, quantized per token and KV head

    def __post_init__(self) -> None:
        self.engine_config()  # a bad option fails here, naming it (a ValueError)

    def engine_config(self) -> EngineConfig:
        """The engine this describes; its KV pool holds `concurrency` requests at their peak."""
        return EngineConfig.sized_for(
            self.model, self.context_tokens, self.concurrency, device=self.device,
            dtype=self.dtype, speculative=self.speculative, prefix_caching=self.prefix_caching,
            kv_policy=self.kv_policy, kv_budget=self.kv_budget if self.kv_policy != "none"
            else None, weights=self.weights, kv_cache_dtype=self.kv_cache_dtype)

    def configuration(self) -> dict[str, Any]:
        """The engine options a measurement ran with, stored beside it (benchmarks, History)."""
        return {"weights": self.weights, "dtype": self.dtype,
                "kv_cache_dtype": self.kv_cache_dtype, "speculative": self.speculative,
                "prefix_caching": self.prefix_caching, "kv_policy": self.kv_policy,
                "kv_budget": self.kv_budget, "context_tokens": self.context_tokens,
                "concurrency": self.concurrency}

    def kv_tokens_per_request(self) -> int:
        """KV slots one request may hold at its peak (the engine's rule)."""
        return self.engine_config().peak_kv_tokens(self.context_tokens)


@dataclass(frozen=True)
class EngineInfo:
    """What the loaded engine reports about itself."""

    model_name: str
    device: str
    dtype: str
    fallback_reason: str | None
    num_kv_blocks: int
    block_size: int
    weight_bytes: int
    kv_cache_bytes: int
    load_s: float
    prefix_caching: bool = False
    kv_policy: str = "none"
    kv_budget: int | float | None = None
    weights: str = "float"
    kv_cache_dtype: str = "auto"

    @classmethod
    def from_llm(cls, llm: Any, load_s: float) -> EngineInfo:
        """Read the facts off a loaded engine.LLM."""
        return cls(str(llm.model_name), str(llm.device), str(llm.dtype), llm.fallback_reason,
                   int(llm.num_kv_blocks), int(llm.block_size), int(llm.weight_bytes),
                   int(llm.kv_cache_bytes), load_s, llm.prefix_cache is not None,
                   llm.kv_policy or "none", llm.kv_budget,
                   str(getattr(llm, "weights", "float")),
                   str(getattr(llm, "kv_cache_dtype", "auto")))

    def summary(self) -> str:
        """One line for the pane: memory actually used, the KV options and the load time."""
        kv = [] if self.kv_cache_dtype == "auto" else [f"{self.kv_cache_dtype} values"]
        if self.prefix_caching:
            kv.append("prefix caching")
        if self.kv_policy != "none":
            kv.append(f"{self.kv_policy} eviction (budget {self.kv_budget})")
        return (f"{self.model_name} on {self.device} ({self.dtype}, {self.weights} weights): "
                "weights "
                f"{format_bytes(self.weight_bytes)}, KV cache {format_bytes(self.kv_cache_bytes)} "
                f"({self.num_kv_blocks} blocks of {self.block_size} tokens"
                f"{''.join(', ' + k for k in kv)}), loaded in {self.load_s:.1f} s")


@dataclass(frozen=True)
class SamplingSettings:
    """The chat's sampling controls; seed < 0 means a fresh random seed per reply."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 256
    seed: int = -1

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": self.max_tokens, "seed": None if self.seed < 0 else self.seed}


@dataclass(frozen=True)
class ReplyFigures:
    """A reply's performance, from the engine's own clock (RequestMetrics)."""

    ttft_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    speculative: str = ""  # "ngram: 9 of 12 draft tokens accepted" when decoding drafted

    @classmethod
    def from_output(cls, output: Any) -> ReplyFigures:
        """Read the figures off an engine RequestOutput."""
        m = output.metrics
        return cls(m.ttft_s, m.prefill_tokens_per_s, m.decode_tokens_per_s,
                   int(m.prompt_tokens), int(m.generated_tokens), str(output.finish_reason))

    def summary(self) -> str:
        """One line under the reply, e.g. "TTFT 85 ms · prefill 410 tok/s · ..."."""
        ttft = "—" if self.ttft_s is None else f"{self.ttft_s * 1000:.0f} ms"
        parts = [f"TTFT {ttft}", f"prefill {_rate(self.prefill_tokens_per_s)}",
                 f"decode {_rate(self.decode_tokens_per_s)}",
                 f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens"]
        if self.speculative:
            parts.append(self.speculative)
        if self.finish_reason != "stop":
            parts.append({"length": "hit max tokens", "abort": "stopped"}.get(
                self.finish_reason, self.finish_reason))
        return " · ".join(parts)


def speculation_text(before: dict | None, after: dict | None) -> str:
    """One reply's drafting, from the engine's speculative counters before and after it:
    "ngram: 9 of 12 draft tokens accepted"; "" when speculative decoding is off."""
    if after is None:
        return ""
    if before is None or before.get("draft_tokens", 0) > after["draft_tokens"]:
        before = {}  # a reload in between started the counters again
    drafted = after["draft_tokens"] - before.get("draft_tokens", 0)
    accepted = after["accepted_tokens"] - before.get("accepted_tokens", 0)
    if drafted <= 0:
        return f"{after['method']}: no draft tokens"
    return f"{after['method']}: {accepted} of {drafted} draft tokens accepted"


def configuration_text(config: dict[str, Any] | None) -> str:
    """"int4 weights · KV int8 · spec ngram:k=10 · prefix caching · h2o KV (512)" for a
    stored configuration; "—" when the measurement did not record one."""
    if not config:
        return "—"
    parts = [f"{config.get('weights', 'float')} weights"]
    if config.get("kv_cache_dtype", "auto") != "auto":
        parts.append(f"KV {config['kv_cache_dtype']}")
    spec = config.get("speculative", "off")
    parts.append("spec off" if spec == "off" else f"spec {spec}")
    if config.get("prefix_caching"):
        parts.append("prefix caching")
    if config.get("kv_policy", "none") != "none":
        parts.append(f"{config['kv_policy']} KV ({config.get('kv_budget')})")
    return " · ".join(parts)


# The names a user knows the load options by, for "changed since loading".
OPTION_NAMES = {"model": "model", "device": "device", "dtype": "dtype",
                "context_tokens": "context", "concurrency": "concurrency",
                "speculative": "speculative decoding", "prefix_caching": "prefix caching",
                "kv_policy": "KV eviction", "kv_budget": "KV budget", "weights": "weights",
                "kv_cache_dtype": "KV cache dtype"}


def changed_options(loaded: LoadRequest | None, wanted: LoadRequest | None) -> list[str]:
    """The options set differently from the loaded model's (they apply on the next load)."""
    if loaded is None or wanted is None:
        return []
    return [name for key, name in OPTION_NAMES.items()
            if getattr(loaded, key) != getattr(wanted, key)]


@dataclass
class ChatTurn:
    """One message of the conversation; assistant turns carry their figures once finished,
    and the (start, end) offsets of the text that came from accepted draft tokens."""

    role: str
    content: str
    figures: ReplyFigures | None = None
    error: str | None = None
    drafted: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ChatSession:
    """The conversation shown in the playground, with at most one reply streaming."""

    turns: list[ChatTurn] = field(default_factory=list)
    streaming: bool = False

    def request_messages(self, system_prompt: str) -> list[dict[str, str]]:
        """Messages for llm.chat/stream: the system prompt, then every finished turn."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        messages += [{"role": t.role, "content": t.content} for t in self.turns
                     if t.error is None and (t.role == "user" or t.content)]
        return messages

    def ask(self, text: str) -> None:
        """Add the user's message and an empty assistant reply to stream into."""
        if self.streaming:
            raise RuntimeError("a reply is still streaming")
        self.turns.append(ChatTurn("user", text))
        self._open_reply()

    def regenerate(self) -> bool:
        """Drop the last reply and open a new one for the same question; False if none."""
        if self.streaming or not self.turns or self.turns[-1].role != "assistant":
            return False
        self.turns.pop()
        self._open_reply()
        return True

    def append(self, text: str, drafted: list[tuple[int, int]] = ()) -> None:
        """Add streamed text to the open reply; `drafted` spans are offsets into `text`."""
        if self.streaming and text:
            turn = self.turns[-1]
            at = len(turn.content)
            turn.drafted += [(at + a, at + b) for a, b in drafted]
            turn.content += text

    def finish(self, figures: ReplyFigures | None, error: str | None = None) -> None:
        """Close the streaming reply with its figures, or with the error that ended it."""
        if not self.streaming:
            return
        self.turns[-1].figures = figures
        self.turns[-1].error = error
        self.streaming = False

    def last_reply(self) -> str:
        """Text of the most recent assistant reply, "" when there is none."""
        replies = [t.content for t in self.turns if t.role == "assistant"]
        return replies[-1] if replies else ""

    def clear(self) -> None:
        """Forget the conversation (not while a reply streams)."""
        if not self.streaming:
            self.turns.clear()

    def _open_reply(self) -> None:
        # The request is built before the empty reply is added, so it never reaches the model.
        self.turns.append(ChatTurn("assistant", ""))
        self.streaming = True


class StreamBuffer:
    """Text handed from the engine thread to the GUI, drained once per frame, with the spans
    of it that came from accepted draft tokens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._length = 0
        self._drafted: list[tuple[int, int]] = []

    def push(self, text: str, drafted: list[tuple[int, int]] = ()) -> None:
        """Append text and its drafted spans, offsets into `text` (engine thread)."""
        with self._lock:
            self._drafted += [(self._length + a, self._length + b) for a, b in drafted]
            self._parts.append(text)
            self._length += len(text)

    def drain(self) -> str:
        """Take everything pushed so far (GUI thread)."""
        return self.drain_marked()[0]

    def drain_marked(self) -> tuple[str, list[tuple[int, int]]]:
        """Take everything pushed so far and its drafted spans (GUI thread)."""
        with self._lock:
            text, drafted = "".join(self._parts), self._drafted
            self._parts, self._drafted, self._length = [], [], 0
        return text, drafted


class RateMeter:
    """Tokens per second over a sliding window, fed from the engine thread and read by the GUI."""

    def __init__(self, window_s: float = 2.0) -> None:
        self._window_s = window_s
        self._lock = threading.Lock()
        self._events: deque[tuple[float, int]] = deque()

    def add(self, tokens: int, now: float | None = None) -> None:
        """Record ``tokens`` produced at ``now`` (perf_counter seconds)."""
        with self._lock:
            self._events.append((time.perf_counter() if now is None else now, tokens))

    def rate(self, now: float | None = None) -> float:
        """Tokens per second over the last window."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self._window_s:
                self._events.popleft()
            return sum(n for _, n in self._events) / self._window_s


@dataclass(frozen=True)
class StepSeries:
    """The recorded steps as columns, for the live chart."""

    steps: list[int]
    kv_blocks_used: list[int]
    tokens_evicted: list[int]  # running total
    prefix_hit_rate: list[float]  # running hits / queries in tokens; nan before any query


class StepHistory:
    """The engine's last steps: KV blocks used, tokens evicted so far and prefix hit rate.

    Fed from the engine thread (an LLM step observer) and read by the GUI; bounded, so a long
    session keeps only its latest `capacity` steps.
    """

    def __init__(self, capacity: int = 2000) -> None:
        self._lock = threading.Lock()
        self._rows: deque[tuple[int, int, int, float]] = deque(maxlen=capacity)
        self._steps = self._evicted = self._queries = self._hits = 0
        self.version = 0  # bumped on every change, so the GUI redraws only when needed

    def record(self, stats: Any) -> None:
        """Add one engine.llm.StepStats (engine thread)."""
        with self._lock:
            self._steps += 1
            self._evicted += stats.num_evicted_tokens
            self._queries += stats.prefix_cache_queries
            self._hits += stats.prefix_cache_hits
            rate = self._hits / self._queries if self._queries else math.nan
            self._rows.append((self._steps, stats.kv_blocks_used, self._evicted, rate))
            self.version += 1

    def reset(self) -> None:
        """Forget everything (a new model was loaded, or it was unloaded)."""
        with self._lock:
            self._rows.clear()
            self._steps = self._evicted = self._queries = self._hits = 0
            self.version += 1

    def series(self) -> StepSeries:
        """A copy of the recorded steps (GUI thread)."""
        with self._lock:
            rows = list(self._rows)
        columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[], [], [], []]
        return StepSeries(*columns)


def format_bytes(n: float | None) -> str:
    """Human-readable size in binary units, e.g. 1.5 GiB."""
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} tok/s"


def memory_verdict(total_bytes: int, device_name: str, device_total: int | None,
                   device_free: int | None) -> tuple[str, str]:
    """Compare an estimate with a device: ("ok"|"warning"|"error", a sentence for the user)."""
    need = format_bytes(total_bytes)
    if device_total is None:
        return "ok", f"Needs about {need}; {device_name} memory is unknown."
    if total_bytes > device_total:
        return "error", (f"Needs about {need} but {device_name} has only "
                         f"{format_bytes(device_total)}: lower the context or concurrency, "
                         "pick a smaller dtype, or choose another device.")
    if device_free is not None and total_bytes > device_free:
        return "warning", (f"Needs about {need}; {device_name} has {format_bytes(device_free)} "
                           f"free of {format_bytes(device_total)}, so loading may fail.")
    free = "" if device_free is None else f"{format_bytes(device_free)} free of "
    return "ok", f"Needs about {need}; {device_name} has {free}{format_bytes(device_total)}."
