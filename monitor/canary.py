"""Quality canary: a bundled held-out text scored through a server's prompt log-probabilities."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from monitor.alerts import AlertRule
from monitor.remote import classify_error
from monitor.types import Poll, Sample, SourceStatus

HELDOUT_PATH = Path(__file__).resolve().parents[1] / "assets" / "canary" / "heldout.txt"
DEFAULT_INTERVAL_S = 300.0
# Alert when perplexity is 2% above the source's baseline. A score is the model's own
# log-probabilities of a fixed text, no sampling: the same server scores it the same to 1e-6 in
# float32 (and within a few tenths of a percent in bfloat16, batched with other requests), so
# 2% is far above the noise, and low enough for H2O at a 10% budget scored by decoding (+4.7%
# on the demo model, benchmarks/canary_sensitivity.py), which a 5% bar missed.
DEFAULT_TOLERANCE = 0.02
DEFAULT_BASELINE_SCORES = 3
DEFAULT_TIMEOUT_S = 120.0  # a CPU server scores a few hundred tokens in seconds, not minutes


class CanaryError(Exception):
    """A canary score that failed; the message is one sentence, `reason` a key of
    monitor.types.REASONS."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CanaryScore:
    """One scoring of the held-out text: perplexity over `tokens` scored prompt tokens (the
    first has no log-probability), their mean log-probability, and the request's wall time."""

    perplexity: float
    tokens: int
    mean_logprob: float
    elapsed_s: float
    via: str  # "echo" (OpenAI's echo + logprobs) or "prompt_logprobs" (vLLM's)


def heldout_text(path: Path | str = HELDOUT_PATH) -> str:
    """The held-out text without its header lines (those starting with '#')."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("#")).strip() + "\n"


# The request bodies that ask for prompt log-probabilities, tried in this order: OpenAI's
# legacy echo (servescope, vLLM), then vLLM's own prompt_logprobs (0: the prompt's token only).
METHODS = {"echo": {"max_tokens": 0, "echo": True, "logprobs": 1},
           "prompt_logprobs": {"max_tokens": 1, "prompt_logprobs": 0}}


def score(url: str, model: str | None, text: str, api_key: str | None = None, *,
          extra_body: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
          methods: tuple[str, ...] = tuple(METHODS), decode_from: int | None = None
          ) -> CanaryScore:
    """Score `text` on the server at `url` (its base, e.g. http://host:8000): POST
    /v1/completions with echo and logprobs, else with vLLM's prompt_logprobs; `extra_body`
    adds fields (e.g. servescope's kv_policy / kv_budget). With `decode_from` (`servescope
    serve` only), the server prefills that many tokens and decodes the rest one at a time
    through its KV cache, and the perplexity is of the decoded tokens alone: what eviction or
    a quantized cache costs a long reply, which a prefill never shows. Raises CanaryError."""
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise ValueError(f"canary methods must be among {sorted(METHODS)}, not {methods!r}")
    endpoint = url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = {"prompt": text, "temperature": 0} | ({"model": model} if model else {})
    base |= extra_body or {}
    if decode_from is not None:
        base["prompt_logprobs_decode_from"] = decode_from
    started = time.perf_counter()
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        refused = []
        for via in methods:
            reply, why = _post(client, endpoint, base | METHODS[via], timeout_s)
            values = None if reply is None else _prompt_values(reply, via)
            if values is not None:
                if decode_from is not None:
                    values = _decoded(reply, values, decode_from, endpoint)
                return _summarise(values, time.perf_counter() - started, via, endpoint)
            refused.append(why or f"answered without them to '{_param(via)}'")
    raise CanaryError(f"{endpoint} returned no prompt log-probabilities: it "
                      f"{' and '.join(refused)}.", "error")


def _decoded(reply: dict, values: list, decode_from: int, endpoint: str) -> list:
    """The decoded positions' values (after one None: _summarise skips the first), once the
    reply says the server scored them by decoding; a server that ignored the field did not."""
    if reply.get("prompt_logprobs_decoded_from") != decode_from:
        raise CanaryError(f"{endpoint} does not score prompts by decoding them (a `servescope "
                          "serve` extension): remove decode= from this canary.", "error")
    return [None, *values[decode_from:]]


def _param(via: str) -> str:
    return "echo' with 'logprobs" if via == "echo" else "prompt_logprobs"


def _post(client: httpx.Client, endpoint: str, body: dict,
          timeout_s: float) -> tuple[dict | None, str | None]:
    """The JSON reply, or (None, how the server refused it); unreachable raises."""
    try:
        response = client.post(endpoint, json=body)
    except httpx.HTTPError as exc:
        reason, sentence = classify_error(exc, endpoint, timeout_s)
        raise CanaryError(f"The canary cannot score: {sentence}.".replace("..", "."),
                          reason) from exc
    if response.status_code in (401, 403):
        raise CanaryError(f"{endpoint} refused the canary's API key (HTTP "
                          f"{response.status_code}).", "http_status")
    if response.status_code == 404 and "model" in response.text.lower():
        raise CanaryError(f"{endpoint} does not serve the model {body.get('model')!r}.",
                          "http_status")
    try:
        reply = response.json()
    except ValueError:
        reply = None
    if response.status_code >= 400 or not isinstance(reply, dict):
        error = reply.get("error") if isinstance(reply, dict) else None
        param = error.get("param") if isinstance(error, dict) else None
        named = f" naming '{param}'" if param else ""
        return None, f"refused {_describe(body)} with HTTP {response.status_code}{named}"
    return reply, None


def _describe(body: dict) -> str:
    return "'echo' with 'logprobs'" if body.get("echo") else "'prompt_logprobs'"


def _prompt_values(reply: dict, via: str) -> list[float | None] | None:
    """Each prompt token's log-probability (None for the first), or None if the reply has
    none. With echo, the list is cut to usage.prompt_tokens (a generated token may follow)."""
    choices = reply.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    if via == "echo":
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        prompt_tokens = (reply.get("usage") or {}).get("prompt_tokens")
        if not isinstance(values, list) or not isinstance(prompt_tokens, int):
            return None
        return values[:prompt_tokens] if len(values) >= prompt_tokens else None
    entries = choice.get("prompt_logprobs", reply.get("prompt_logprobs"))
    if not isinstance(entries, list) or not entries:
        return None
    # vLLM's shape: None, then {token_id: {"logprob", "rank", "decoded_token"}} with the
    # prompt's own token first (alone with prompt_logprobs 0).
    return [None if e is None else next(iter(e.values()), {}).get("logprob")
            for e in entries if e is None or isinstance(e, dict)]


def summarise(values: list, elapsed_s: float, via: str, endpoint: str) -> CanaryScore:
    """A score from every prompt token's log-probability (the first, without context, None):
    what a server returns, or what the embedded engine computes from its own logits."""
    return _summarise(values, elapsed_s, via, endpoint)


def _summarise(values: list, elapsed_s: float, via: str, endpoint: str) -> CanaryScore:
    scored = values[1:]  # the first token has no context, so no log-probability
    if not scored:
        raise CanaryError(f"{endpoint} scored only one token: the canary text is too short.")
    bad = [v for v in scored if not isinstance(v, int | float) or not math.isfinite(v)]
    if bad:
        raise CanaryError(f"{endpoint} returned {len(bad)} non-finite or missing prompt "
                          f"log-probabilities of {len(scored)} (e.g. {bad[0]!r}).",
                          "non_finite")
    mean = math.fsum(scored) / len(scored)
    return CanaryScore(math.exp(-mean), len(scored), mean, elapsed_s, via)


@dataclass
class CanaryBaseline:
    """A source's reference perplexity: the median of its first `scores` scores, or a value
    the user pins."""

    scores: int = DEFAULT_BASELINE_SCORES
    pinned: float | None = None
    seen: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.scores < 1:
            raise ValueError("the canary baseline needs at least one score")
        if self.pinned is not None and not (math.isfinite(self.pinned) and self.pinned >= 1):
            raise ValueError(f"a pinned perplexity must be a finite number >= 1, not "
                             f"{self.pinned!r}")

    @property
    def value(self) -> float | None:
        """The baseline, or None while fewer than `scores` scores have been seen."""
        if self.pinned is not None:
            return self.pinned
        return statistics.median(self.seen) if len(self.seen) >= self.scores else None

    def add(self, perplexity: float) -> None:
        if self.pinned is None and len(self.seen) < self.scores:
            self.seen.append(perplexity)


def drift_ratio(perplexity: float, baseline: float) -> float:
    """Perplexity over the baseline: 1.0 unchanged, 1.14 a 14% loss."""
    return perplexity / baseline


def canary_rule(source: str, tolerance: float = DEFAULT_TOLERANCE,
                interval_s: float = DEFAULT_INTERVAL_S) -> AlertRule:
    """An alert when the source's drift ratio exceeds 1 + tolerance: the mean over 1.5
    intervals, so the last score or two (the hub polls on the interval), fires and clears."""
    if not tolerance > 0:
        raise ValueError("the canary tolerance must be positive")
    return AlertRule(f"{source} canary perplexity drift", f"{source}/canary_drift",
                     1.0 + tolerance, window_s=1.5 * interval_s)


class CanarySource:
    """Scores the held-out text on a server every `interval_s` and emits
    `<name>/canary_perplexity`, `<name>/canary_tokens` and, once the baseline is known,
    `<name>/canary_drift` (perplexity / baseline)."""

    def __init__(self, name: str, url: str, model: str | None = None, *,
                 interval_s: float = DEFAULT_INTERVAL_S, text: str | None = None,
                 api_key: str | None = None, baseline: CanaryBaseline | None = None,
                 extra_body: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 decode_from: int | None = None) -> None:
        if not name or "/" in name:
            raise ValueError(f"canary name {name!r} must be non-empty and without '/'")
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("the canary's interval and timeout must be positive")
        if decode_from is not None and decode_from < 1:
            raise ValueError("the canary's decode= must be a token index of at least 1")
        self.decode_from = decode_from
        self.name, self.url, self.model = name, url, model
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.text = heldout_text() if text is None else text
        self.api_key, self.extra_body = api_key, extra_body
        self.baseline = baseline or CanaryBaseline()
        self.status = SourceStatus(kind="canary")
        self.last: CanaryScore | None = None

    def poll(self, now: float) -> Poll:
        self.status.scrapes += 1
        try:
            result = score(self.url, self.model, self.text, self.api_key,
                           extra_body=self.extra_body, timeout_s=self.timeout_s,
                           decode_from=self.decode_from)
        except CanaryError as exc:
            self.status.failed_scrapes += 1
            self._set_state("down", now, str(exc), exc.reason)
            return Poll()
        self.last = result
        self._set_state("up", now)
        self.status.last_ok = now
        self.baseline.add(result.perplexity)
        p = f"{self.name}/"
        samples = [Sample(p + "canary_perplexity", now, result.perplexity),
                   Sample(p + "canary_tokens", now, float(result.tokens))]
        if self.baseline.value is not None:
            samples.append(Sample(p + "canary_drift", now,
                                  drift_ratio(result.perplexity, self.baseline.value)))
        return Poll(samples)

    def _set_state(self, state: str, now: float, error: str | None = None,
                   reason: str | None = None) -> None:
        if self.status.state != state:
            self.status.since = now
        self.status.state, self.status.reason = state, reason
        self.status.message = error or ""
        if error is not None:
            self.status.last_error = error

    def close(self) -> None:
        """Nothing to release: each score opens and closes its own HTTP connection."""


def parse_canary(spec: str, api_key: str | None = None) -> CanarySource:
    """A CanarySource from `NAME=URL[,every=S][,model=M][,baseline=PPL][,decode=N]` (the
    command line's form); a mistake raises ValueError naming it."""
    name, sep, rest = spec.partition("=")
    if not sep or not rest:
        raise ValueError(f"--canary {spec!r}: give NAME=URL, e.g. srv=http://127.0.0.1:8000")
    url, *options = rest.split(",")
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ValueError(f"--canary {spec!r}: {url!r} is not an http(s) URL")
    known = {"every": float, "model": str, "baseline": float, "decode": int}
    values: dict = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in known or not value:
            raise ValueError(f"--canary {spec!r}: unknown or empty option {option!r}; use "
                             "every=SECONDS, model=NAME, baseline=PERPLEXITY or decode=TOKENS")
        try:
            values[key] = known[key](value)
        except ValueError:
            raise ValueError(f"--canary {spec!r}: {key}={value!r} is not a number") from None
    return CanarySource(name, url, values.get("model"), api_key=api_key,
                        interval_s=values.get("every", DEFAULT_INTERVAL_S),
                        baseline=CanaryBaseline(pinned=values.get("baseline")),
                        decode_from=values.get("decode"))
