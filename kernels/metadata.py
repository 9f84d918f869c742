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
    mask: torch.Tensor | None  # [q_len, context_len] bool; None for a fresh causal prefill
    # With AttentionMetadata.want_mass: sum the attention of only the chunk's last `mass_rows`
    # queries (SnapKV's observation window); None sums every query of the chunk.
    mass_rows: int | None = None


@dataclass
class AttentionMetadata:
    """Per-step attention layout, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    decode_token_index: torch.Tensor | None = None  # [B] rows of single-token queries
    decode_slots: torch.Tensor | None = None  # [B, T] key slots per decode query (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool, None when nothing is padded
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
