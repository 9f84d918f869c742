"""Admission checks: whether a request can ever run on this engine, decided before it queues.

Each refusal is a RequestError naming the problem and what to change (a prompt past the
context, a request larger than the KV pool, an eviction policy that cannot work here).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_eviction import KVState, parse_policy
from engine.kv_options import eviction_chunk, peak_kv_tokens, resolve_budget
from engine.sequence import RequestError, SamplingParams

Prompt = str | list[int]


@dataclass
class Admission:
    """The engine's limits a request is checked against (set once the engine is built)."""

    tokenizer: object
    vocab_size: int
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    kv_cache_tokens: int
    kv_policy: str | None = None
    kv_budget: int | float | None = None
    num_draft_tokens: int = 0  # speculative drafts a decode step may add
    draft_model_cache: bool = False  # a draft model mirrors the target's cache block for block

    def check(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], KVState | None]:
        """The prompt's token ids and the request's eviction state; RequestError if it can
        never run."""
        ids = self.prompt_ids(prompt)
        kv = self.kv_state(ids, params)
        self.check_fits(ids, params, kv)
        return ids, kv

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("The prompt is empty: give at least one token.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"Token id {bad[0]} is outside the vocabulary (0.."
                               f"{self.vocab_size - 1}): check the token ids.")
        return ids

    def kv_state(self, ids: list[int], params: SamplingParams) -> KVState | None:
        """The request's eviction policy and budget in tokens (its own, else the engine's)."""
        name = params.kv_policy if params.kv_policy is not None else self.kv_policy
        policy = parse_policy(name)
        if policy is None:
            return None
        self.check_policy_allowed()
        budget = params.kv_budget if params.kv_budget is not None else self.kv_budget
        tokens = resolve_budget(budget, len(ids) + params.max_tokens, self.block_size)
        state = KVState(policy, tokens)
        if policy.repositions:
            chunk = self.eviction_chunk(ids, state)
            peak = peak_kv_tokens(tokens, self.block_size, chunk)
            if peak >= self.max_model_len:
                raise RequestError(
                    f"With {policy.name} the cache holds up to {peak} tokens (kv_budget {tokens}, "
                    f"one block, a step's chunk of up to {chunk}: prompt or speculative drafts) "
                    f"but the context holds {self.max_model_len}: lower kv_budget or "
                    "max_num_batched_tokens.")
        return state

    def eviction_chunk(self, ids: list[int], kv: KVState) -> int:
        """The most tokens the sequence computes in one step before compacting."""
        return eviction_chunk(len(ids), kv.policy.holds_prompt, self.max_num_batched_tokens,
                              self.num_draft_tokens)

    def check_policy_allowed(self) -> None:
        if self.draft_model_cache:
            raise RequestError("KV eviction does not work with a draft model (its cache mirrors "
                               "the target's block for block): use --spec ngram or no eviction.")

    def check_fits(self, ids: list[int], params: SamplingParams,
                    kv: KVState | None = None) -> None:
        unbounded = kv is not None and kv.policy.repositions  # positions stay within the cache
        if len(ids) >= self.max_model_len and not unbounded:
            raise RequestError(
                f"The prompt has {len(ids)} tokens but the context holds {self.max_model_len}: "
                "shorten the prompt or load the model with a longer max_model_len.")
        need = len(ids) + params.max_tokens
        if not unbounded:
            need = min(need, self.max_model_len)
        if kv is not None:
            need = min(need, peak_kv_tokens(kv.budget, self.block_size,
                                            self.eviction_chunk(ids, kv)))
        if need > self.kv_cache_tokens:
            raise RequestError(
                f"The request needs up to {need} KV slots ({len(ids)} prompt + {params.max_tokens} "
                f"new tokens) but the KV pool holds {self.kv_cache_tokens}: lower max_tokens or "
                "raise kv_cache_tokens.")
