"""KV eviction options as users type them (CLI flags, HTTP fields, the app), without torch.

The budget is an int (tokens) or a float in (0, 1] (a fraction of each request's length), as
`LLM(kv_budget=...)` takes it; text is read so that "512" is tokens and "0.2" a fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.sequence import RequestError

POLICIES = ("none", "streaming", "h2o", "scissorhands", "snapkv")
_ALIASES = {"streamingllm": "streaming", "heavy-hitter": "h2o", "off": "none"}


@dataclass(frozen=True)
class PolicyTraits:
    """What a policy does to the cache's size and positions (its class in engine.kv_eviction
    reads these, so the torch-free sizing rules and the policy agree)."""

    repositions: bool = False  # kept keys move to new positions (runs past the context)
    holds_prompt: bool = False  # keeps the whole prompt until the prompt ends


TRAITS = {"streaming": PolicyTraits(repositions=True), "h2o": PolicyTraits(),
          "scissorhands": PolicyTraits(), "snapkv": PolicyTraits(holds_prompt=True)}


def policy_name(name: str | None) -> str:
    """The canonical policy name ("none" for no eviction); a clear error for anything else."""
    if name is None:
        return "none"
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in POLICIES:
        raise RequestError(f"Unknown KV eviction policy '{name}': choose one of "
                           f"{', '.join(POLICIES)}.")
    return key


def resolve_budget(budget: int | float | None, total_tokens: int, block_size: int) -> int:
    """The budget in tokens: an int is tokens, a float in (0, 1] a fraction of the request's
    full length (prompt + max_tokens), as kvpress states compression ratios."""
    if budget is None:
        raise RequestError("A KV eviction policy needs kv_budget: tokens (e.g. 512) or a "
                           "fraction of the request's length (e.g. 0.2).")
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise RequestError(f"kv_budget must be a number of tokens or a fraction, got {budget!r}.")
    minimum = 2 * block_size
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise RequestError(f"kv_budget as a fraction must be in (0, 1], got {budget}.")
        # A fraction of a short request may come out below the minimum: round it up.
        return max(math.ceil(budget * total_tokens), minimum)
    tokens = budget
    if tokens < minimum:
        raise RequestError(f"kv_budget of {tokens} tokens is below the minimum of {minimum} "
                           f"(two KV blocks): raise kv_budget.")
    return tokens


def eviction_chunk(prompt_tokens: int, holds_prompt: bool, max_num_batched_tokens: int,
                   num_draft_tokens: int) -> int:
    """The most tokens a sequence under eviction computes in one step beyond its budget and a
    block, before compacting: a prefill chunk, or a decode token and its speculative drafts;
    a policy that holds the prompt (SnapKV) holds all of it until it ends."""
    chunk = prompt_tokens if holds_prompt else min(prompt_tokens, max_num_batched_tokens)
    return max(chunk, 1 + num_draft_tokens)


def peak_kv_tokens(budget_tokens: int, block_size: int, chunk: int) -> int:
    """KV slots a sequence under eviction may hold at its peak: the budget, a block of slack
    and one step's chunk (compaction runs after the step)."""
    return budget_tokens + block_size + chunk


def parse_kv_budget(value: str | int | float | None) -> int | float | None:
    """An int of tokens or a float fraction from text or a JSON number; None stays None."""
    if value is None or isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            pass
    raise RequestError(f"kv_budget must be a number of tokens (e.g. 512) or a fraction of the "
                       f"request's length (e.g. 0.2), got {value!r}.")


KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # kernels.kv_quant.STORAGE's names, plus "auto"


def parse_kv_cache_dtype(value: str | None) -> str:
    """"auto" (the model's dtype), "int8" or "fp8" (e4m3), each quantized with a scale per token
    and KV head (kernels/kv_quant.py); anything else is a RequestError naming the choices."""
    text = (value or "auto").strip().lower()
    if text in ("float8", "fp8_e4m3", "float8_e4m3fn"):
        text = "fp8"
    if text not in KV_CACHE_DTYPES:
        raise RequestError(f"Unknown KV cache dtype '{value}': use auto (the model's dtype), "
                           "int8 or fp8.")
    return text


def kv_cache_bytes(kv_cache_dtype: str, model_element_bytes: int) -> tuple[int, int]:
    """(bytes per cached number, bytes of scale per token and KV head) of a KV cache dtype."""
    if kv_cache_dtype == "auto":
        return model_element_bytes, 0
    return 1, 4  # int8 / fp8 values with a float32 scale
