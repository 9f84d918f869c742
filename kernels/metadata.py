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


@dataclass
class AttentionMetadata:
    """Per-step attention layout, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    decode_token_index: torch.Tensor | None = None  # [B] rows of single-token queries
    decode_slots: torch.Tensor | None = None  # [B, T] key slots per decode query (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool, None when nothing is padded
    prefills: list[PrefillChunk] = field(default_factory=list)
