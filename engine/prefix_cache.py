"""Prefix caching: requests that share a prompt prefix share its KV blocks instead of recomputing.

Block-granular, like vLLM's automatic prefix caching rather than SGLang's token-granular radix
tree: the paged cache already works in blocks, a block is the unit that can be shared by
reference count, and a chained hash per full block (hash of the parent's hash and the block's
tokens) finds the longest cached prefix in one dictionary look-up per block. The chain makes
the hash stand for the whole prefix, so a block is reused only after the very same tokens.
The cost: a shared prefix is matched only in whole blocks (up to block_size - 1 tokens of it
are recomputed).

A block's identity is SHA-256 over its parent's digest and its tokens, chained from a root
digest of everything else that makes the cached keys and values differ (the model file, its
dtype, weight format and KV-cache dtype). Python's builtin `hash()` was used before: it is
deterministic and easy to invert for integers, so a client could build a prompt whose blocks
collide with another's and be served (or poison) their KV entries; vLLM fixed the same class
(GHSA-rm76-4mrf-v9r8). A hit is also checked against the tokens the block was filled with.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.features import Step, StepFeature
from engine.sequence import Sequence


@dataclass
class PrefixCacheCounters:
    """vLLM's prefix-cache counters, in tokens."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float | None:
        return None if not self.queries else self.hits / self.queries


class PrefixCache(StepFeature):
    """Matches new sequences against cached blocks (the scheduler asks, on admission) and
    indexes blocks as they fill (a step feature of the engine core)."""

    def __init__(self, block_manager: BlockManager, identity: str = "") -> None:
        self.bm = block_manager
        self.counters = PrefixCacheCounters()
        self.root = hashlib.sha256(b"servescope-prefix-v1\0" + identity.encode()).digest()

    def after_forward(self, step: Step) -> None:
        # A sequence under an eviction policy keeps its blocks private (it may move them).
        for s in step.scheduled:
            if s.seq.kv is None:
                self.register(s.seq)

    def on_preempt(self, seq: Sequence) -> None:
        seq.num_cached_blocks = 0

    def match(self, seq: Sequence) -> int:
        """Share the longest cached prefix with a sequence that holds no blocks; tokens reused.

        At least one token is left to compute, because its logits pick the next token.
        """
        bs = self.bm.block_size
        tokens = seq.all_token_ids
        limit = (len(tokens) - 1) // bs
        hashes = block_hashes(tokens, bs, limit, self.root)
        matched = []
        for i, h in enumerate(hashes):
            block_id = self.bm.cached_block(h)
            if block_id is None or self.bm.block_tokens[block_id] != tuple(
                    tokens[i * bs : (i + 1) * bs]):
                break  # not cached, or a digest collision: never share other tokens' KV
            matched.append(block_id)
        self.bm.share(seq, matched)
        seq.num_computed_tokens = len(matched) * bs
        seq.num_cached_blocks = len(matched)
        return seq.num_computed_tokens

    def unmatch(self, seq: Sequence) -> None:
        """Give back what match() shared when the sequence cannot be admitted after all."""
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def count(self, seq: Sequence) -> tuple[int, int]:
        """Record an admitted sequence's look-up: (tokens queried, tokens found)."""
        queried, hit = seq.num_tokens, seq.num_computed_tokens
        self.counters.queries += queried
        self.counters.hits += hit
        return queried, hit

    def register(self, seq: Sequence) -> None:
        """Index the sequence's blocks that are full of computed tokens and not indexed yet."""
        bs = self.bm.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        tokens = seq.all_token_ids
        hashes = block_hashes(tokens, bs, full, self.root)
        for i in range(seq.num_cached_blocks, full):
            self.bm.register(seq.block_table[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
        seq.num_cached_blocks = full


def block_hashes(tokens: list[int], block_size: int, count: int,
                 root: bytes = b"") -> list[bytes]:
    """Chained SHA-256 digests of the first `count` full blocks of `tokens`, from `root`."""
    hashes, parent = [], root
    for i in range(count):
        block = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes
