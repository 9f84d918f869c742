"""Torch reference implementations of the engine's ops: the CPU path and the oracle for kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def prepare_linear(weight: torch.Tensor) -> torch.Tensor:
    """The layout `linear` wants; the reference uses the weight as it is."""
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias."""
    return F.linear(x, weight, bias)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x + residual`; returns (normed, new residual) like vLLM's fused op."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The Hugging Face rotary convention: rotate the two halves of the head dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE; q [N, H, D], k [N, Hkv, D], cos/sin [N, D] already gathered at the positions."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, with gate and up concatenated on the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([N, Hkv, D]) into flat cache slots ([slots, Hkv, D])."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat batch of queries ([N, H, D]) over the paged cache -> [N, H, D].

    Decode-like sequences (one query token) are batched into one padded call; each prefill chunk
    runs on its own so that no query is padded to the longest chunk.
    """
    out = torch.empty_like(q)
    if meta.decode_token_index is not None:
        out[meta.decode_token_index] = _decode_attention(q[meta.decode_token_index], k_cache,
                                                         v_cache, meta, scale)
    for chunk in meta.prefills:
        qs = q[chunk.start : chunk.end]
        out[chunk.start : chunk.end] = _prefill_attention(qs, k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    # [B, T, Hkv, D] -> [B, Hkv, T, D]; the query heads of one KV head become query rows, so
    # grouped-query attention needs no copy of K/V per query head.
    k = _gather(k_cache, meta.decode_slots).permute(0, 2, 1, 3)
    v = _gather(v_cache, meta.decode_slots).permute(0, 2, 1, 3)
    qg = q.view(batch, kv_heads, group, dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(batch, heads, dim)


def _prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk, scale: float
) -> torch.Tensor:
    k = _gather(k_cache, chunk.slots).transpose(0, 1)
    v = _gather(v_cache, chunk.slots).transpose(0, 1)
    # A leading batch dimension: with 3-D inputs the CPU falls back to the slow math kernel.
    qh, k, v = q.transpose(0, 1)[None], k[None], v[None]
    if chunk.mask is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=chunk.mask, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache rows at `slots` (any shape) -> slots.shape + cache row shape; index_select is far
    cheaper than advanced indexing on the CPU."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
