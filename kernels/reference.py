"""Torch reference implementations of the engine's ops: the CPU path and the oracle for kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import kv_quant
from kernels.kv_quant import QuantizedCache
from kernels.metadata import AttentionMass, AttentionMetadata


def prepare_linear(weight: torch.Tensor) -> torch.Tensor:
    """The layout `linear` wants; the reference uses the weight as it is."""
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias."""
    return F.linear(x, weight, bias)


def prepare_decode_stack(layers: list, dims: dict) -> None:
    """No fused decode step here: the model runs its layers op by op (kernels/cpu_layers.py
    has the CPU's)."""
    return None


def prepare_draft_level(*weights, **options) -> None:
    """No fused draft level here: a hidden-state draft composes its levels from the table's ops
    (kernels/cpu_draft.py has the CPU's)."""
    return None


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


def softmax_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest softmax probabilities (float32, largest first) and their columns
    ([rows, k] each), for scores [rows, n]: a draft tree's next tokens."""
    return torch.softmax(scores.float(), dim=-1).topk(k, dim=-1)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([N, Hkv, D]) into flat cache slots ([slots, Hkv, D]), quantized
    when the cache is a QuantizedCache."""
    if isinstance(k_cache, QuantizedCache):
        kv_quant.store(k_cache, k, slot_mapping)
        kv_quant.store(v_cache, v, slot_mapping)
        return
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
    return attend_rows(q, k_cache, v_cache, meta, scale, _decode_attention)


def attend_rows(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                decode, prefill=None) -> torch.Tensor:
    """paged_attention with the step's decode rows attended by `decode` (the same arguments as
    _decode_attention, the rows in decode_token_index order) and its prefill chunks by `prefill`
    (_prefill_attention's arguments; by default that function)."""
    prefill = prefill or _prefill_attention
    if meta.decode_token_index is not None and not meta.prefills \
            and meta.decode_token_index.shape[0] == q.shape[0]:
        # A decode-only step: its rows are the decode rows, in order (no gather, no scatter).
        return decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.decode_token_index is not None:
        out[meta.decode_token_index] = decode(q[meta.decode_token_index], k_cache, v_cache,
                                              meta, scale)
    for chunk in meta.prefills:
        qs = q[chunk.start : chunk.end]
        out[chunk.start : chunk.end] = prefill(qs, k_cache, v_cache, chunk, scale)
    return out


def paged_attention_mass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> tuple[torch.Tensor, AttentionMass]:
    """paged_attention plus the attention mass each key received (see AttentionMass).

    An explicit softmax instead of scaled_dot_product_attention, whose fused kernels never
    materialise the probabilities; slower, so the model calls it only when a KV-eviction
    policy needs the statistics.
    """
    out = torch.empty_like(q)
    decode_mass = None
    if meta.decode_token_index is not None:
        rows = meta.decode_token_index
        out[rows], decode_mass = _decode_attention_mass(q[rows], k_cache, v_cache, meta, scale)
    prefill_mass = []
    for chunk in meta.prefills:
        o, mass = _prefill_attention_mass(q[chunk.start : chunk.end], k_cache, v_cache, chunk,
                                          scale)
        out[chunk.start : chunk.end] = o
        prefill_mass.append(mass)
    return out, AttentionMass(decode_mass, prefill_mass)


def _decode_attention_mass(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    k = _gather(k_cache, meta.decode_slots, q.dtype).permute(0, 2, 1, 3)  # [B, Hkv, T, D]
    v = _gather(v_cache, meta.decode_slots, q.dtype).permute(0, 2, 1, 3)
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, T]
    if meta.decode_mask is not None:
        scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs.to(v.dtype) @ v).reshape(batch, heads, dim)
    return out, probs.sum(dim=2)


def _prefill_attention_mass(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, dim = q.shape
    k = _gather(k_cache, chunk.slots, q.dtype).transpose(0, 1)  # [Hkv, T, D]
    v = _gather(v_cache, chunk.slots, q.dtype).transpose(0, 1)
    kv_heads, ctx = k.shape[0], k.shape[1]
    qg = q.transpose(0, 1).reshape(kv_heads, heads // kv_heads, n, dim)
    scores = (qg @ k.unsqueeze(1).transpose(-1, -2)).float() * scale  # [Hkv, G, n, T]
    mask = chunk.mask
    if mask is None:
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = (probs.to(v.dtype) @ v.unsqueeze(1)).reshape(heads, n, dim).transpose(0, 1)
    rows = probs if chunk.mass_rows is None else probs[:, :, n - chunk.mass_rows :]
    return out, rows.sum(dim=(1, 2))


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    # [B, T, Hkv, D] -> [B, Hkv, T, D]; the query heads of one KV head become query rows, so
    # grouped-query attention needs no copy of K/V per query head.
    k = _gather(k_cache, meta.decode_slots, q.dtype).permute(0, 2, 1, 3)
    v = _gather(v_cache, meta.decode_slots, q.dtype).permute(0, 2, 1, 3)
    qg = q.view(batch, kv_heads, group, dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(batch, heads, dim)


def _prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk, scale: float
) -> torch.Tensor:
    k = _gather(k_cache, chunk.slots, q.dtype).transpose(0, 1)
    v = _gather(v_cache, chunk.slots, q.dtype).transpose(0, 1)
    # A leading batch dimension: with 3-D inputs the CPU falls back to the slow math kernel.
    qh, k, v = q.transpose(0, 1)[None], k[None], v[None]
    if chunk.mask is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=chunk.mask, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


def _gather(cache: torch.Tensor | QuantizedCache, slots: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """cache rows at `slots` (any shape) -> slots.shape + cache row shape, dequantized to `dtype`
    from a quantized cache; index_select is far cheaper than advanced indexing on the CPU."""
    if isinstance(cache, QuantizedCache):
        return kv_quant.gather(cache, slots, dtype)
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
