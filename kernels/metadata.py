"""Attention metadata: where each query token's keys live in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One sequence's chunk of query tokens (rows start:end of the flat batch) and its context."""

    start: int
    end: int
    slots: torch.Tensor  # [context_len] cache slots of every key the chunk attends to
    # [q_len, context_len] bool; None for a fresh causal prefill (context_len == q_len)
    mask: torch.Tensor | None
    # With AttentionMetadata.want_mass: sum the attention of only the chunk's last `mass_rows`
    # queries (SnapKV's observation window); None sums every query of the chunk.
    mass_rows: int | None = None
    # True where the mask is known to be the plain causal one (query i sees the keys up to
    # position context_len - q_len + i), which a kernel may then apply without reading it;
    # the runner says so for every chunk but a draft tree's.
    causal: bool = False


@dataclass
class AttentionMetadata:
    """Per-step attention layout, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    decode_token_index: torch.Tensor | None = None  # [B] rows of single-token queries
    decode_slots: torch.Tensor | None = None  # [B, T] key slots per decode query (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool, None when nothing is padded
    # [B] int64 keys per decode row (rows are padded at the end: the mask's True prefix), for
    # kernels that read each row's own keys only; None: derive it from decode_mask.
    decode_lengths: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    want_mass: bool = False  # the model calls paged_attention_mass, for KV-eviction statistics


@dataclass
class AttentionMass:
    """How much attention each cached key received this step, per KV head (eviction statistics).

    `decode`: [B, Hkv, T] float32 for the decode rows in `decode_token_index` order: the softmax
    probabilities summed over the query heads that share each KV head (0 at padded positions).
    `prefill`: per prefill chunk, [Hkv, context_len] float32, the same summed also over the
    chunk's queries (or its last `mass_rows`).
    """

    decode: torch.Tensor | None
    prefill: list[torch.Tensor]


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth in a token tree whose node i hangs under `parents[i]` (-1: under the
    root, the sequence's last real token, at depth 0). Parents come before their children."""
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: a parent must be an earlier "
                             "node or -1 (the root)")
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def ancestor_mask(parents: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[n, n] bool: row i is True at node i and each of its ancestors (not the root), the tree
    nodes a tree-verification query attends to beside the context."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]  # the parent's row is complete: parents come first
    return mask.to(device) if device is not None else mask
