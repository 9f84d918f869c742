"""Requests as the engine sees them: sampling parameters, sequences, metrics and outputs."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request the engine cannot run (too long for the context or the KV pool, bad params)."""


# torch.Generator.manual_seed's inclusive range: a seed outside it fails inside the sampler.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; temperature 0 means greedy, top_k 0 means off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties: logits -= frequency_penalty * count + presence_penalty * (count > 0),
    # counted over the tokens generated so far; logit_bias adds to chosen tokens' logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities to return: None = none; k = the chosen token's and the k most likely
    # (per generated token; prompt_logprobs per prompt token, computed apart by the caller).
    logprobs: int | None = None
    # Constrained decoding (engine/grammar.py): a GrammarSpec every reply must match.
    grammar: object | None = None
    # KV eviction for this request (engine/kv_eviction.py); None takes the engine's setting.
    kv_policy: str | None = None
    kv_budget: int | float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be within [{SEED_MIN}, {SEED_MAX}], got {self.seed}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
            (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2,
             "presence_penalty and frequency_penalty must be within [-2, 2]"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias maps token ids >= 0 to biases within [-100, 100]"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before choosing a token."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.grammar is not None)


@dataclass
class RequestMetrics:
    """Timestamps from the engine's clock (time.perf_counter seconds) and figures from them."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def generated_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT definition)."""
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        start = self.first_scheduled
        if self.first_token is None or start is None or self.first_token <= start:
            return None
        return self.prompt_tokens / (self.first_token - start)

    @property
    def decode_tokens_per_s(self) -> float | None:
        tpot = self.tpot_s
        return None if not tpot else 1.0 / tpot

    def as_dict(self) -> dict:
        """The figures as plain JSON-able values (milliseconds for times)."""
        def ms(v: float | None) -> float | None:
            return None if v is None else v * 1000.0

        return {
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "itl_ms": [v * 1000.0 for v in self.itl_s],
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a finished (or streaming) request produced."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    # Why the engine failed this request alone (finish_reason "error"), in one sentence.
    error: str | None = None
    # One TokenLogprob (engine/logprobs.py) per generated token, when the params asked.
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """New text and tokens of one request since the previous delta; `output` is set at the end."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    logprobs: list | None = None  # the new tokens' TokenLogprobs, when the params asked
    # (start, end) offsets into `text` of text from accepted draft tokens (speculation)
    drafted: list[tuple[int, int]] = field(default_factory=list)


class Sequence:
    """One request's tokens, KV blocks and progress through prefill and decode."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: float) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(arrival=arrival, prompt_tokens=len(prompt_token_ids))
        self.num_preemptions = 0
        self.generator = None  # a torch.Generator, created by the sampler on first use
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted_text_len = 0
        self.emitted_token_len = 0
        self.spec = None  # SpecState (engine/spec/state.py), made by the spec feature
        self.num_cached_blocks = 0  # leading blocks indexed by the prefix cache
        # KV eviction (engine/kv_eviction.py): computed tokens no longer cached, the position of
        # cache index 0 for new tokens (position = cache index + offset), and the policy state.
        self.num_evicted = 0
        self.position_offset = 0
        self.kv = None
        # The most tokens one step may compute for it (None: the step's budget). Eviction sizes
        # its cache's peak by the prompt's chunk; a preempted sequence recomputes its outputs
        # too, and must do so in chunks no larger.
        self.max_chunk_tokens: int | None = None
        self.forced = None  # ForcedTokens (engine/teacher_forcing.py): evaluation only
        self.error: str | None = None  # why the engine failed this request alone (llm.py)
        # One TokenLogprob per output token (engine/logprobs.py), when the params ask.
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.grammar = None  # a Matcher (engine/grammar.py) the output processor advances
        # Another choice of the same request (n > 1) whose full prompt blocks this one shares
        # once that one has computed them (Scheduler._fork), instead of recomputing them.
        self.prompt_source: Sequence | None = None
        # (start, end) offsets into `text` of accepted draft tokens' text, in order.
        self.drafted_spans: list[tuple[int, int]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def draft_tokens(self) -> list[int]:
        """Drafts proposed for the next step, not yet verified (speculative decoding)."""
        return [] if self.spec is None else self.spec.tokens

    @property
    def kv_len(self) -> int:
        """Tokens whose keys and values the cache holds (computed minus evicted)."""
        return self.num_computed_tokens - self.num_evicted

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            error=self.error,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
