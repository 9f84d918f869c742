"""Triton kernels for CUDA: the same ops and semantics as kernels.reference, which is their oracle.

Attention reads keys through the step's flat slot tables (`decode_slots`, each chunk's `slots`)
rather than block tables: one int64 per key is a small read next to the key's head_dim values, and
a slot table also serves caches whose blocks are not filled in order (eviction). Masks are read as
given, so a kernel agrees with the reference on any mask, not just the runner's causal ones.

On the CPU these kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before this
module is imported); the tests use that, the engine uses the reference there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import QMAX, QuantizedCache
from kernels.metadata import AttentionMass, AttentionMetadata, PrefillChunk

OPS = ("rms_norm", "rotary", "silu_and_mul", "store_kv", "paged_attention",
       "paged_attention_mass")

# Key block of the decode kernel and query x key tile of the prefill kernel (float32 tiles
# halved: at 64 x 64 with head dim 128 they need 115 KB of shared memory, more than the 99 KB of
# consumer GPUs).
_DECODE_BLOCK_N = 64
# A decode split covers at least this many keys; off CUDA (the interpreter) the split count
# assumes a GPU of this many multiprocessors, so the tests exercise the split path.
_MIN_SPLIT_KEYS = 256
_INTERPRETER_UNITS = 16
_PREFILL_BLOCK = {torch.float32: 32}
_PREFILL_BLOCK_DEFAULT = 64


def _pow2(n: int, least: int = 1) -> int:
    """The block size covering n: tl.arange needs powers of two, tl.dot at least 16 per side."""
    return max(least, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 matmuls in full precision (Triton's default is TF32 on GPUs that have it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- fused RMSNorm with residual ----
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res,
                     stride_out, stride_res_out, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the input dtype before the norm, as the reference's x + residual.
        r = tl.load(res_ptr + row * stride_res + cols, mask=valid, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=valid)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, w * normed, mask=valid)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x + residual` in one pass; returns (normed, new residual) like the reference."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if residual is None:
        res_in = res_out = x2  # unused by the kernel: the new residual is x itself
    else:
        res_in = _rows(residual)
        res_out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res_in, weight, out, res_out, hidden, x2.stride(0), res_in.stride(0), out.stride(0),
        res_out.stride(0), eps, HAS_RESIDUAL=residual is not None, BLOCK=_pow2(hidden))
    new_residual = x if residual is None else res_out.view(x.shape)
    return out.view(*x.shape[:-1], hidden), new_residual


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit stride on the last dimension (a view when possible)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


# ---- rotary embedding ----
@triton.jit
def _rotate(x_ptr, out_ptr, stride_xn, stride_xh, stride_on, stride_oh, n_heads, token, c1, c2,
            s1, s2, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's heads, in the rotate_half layout: out = x * cos + [-x2, x1] * sin."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    valid = (h < n_heads) & (d < HALF)
    first = x_ptr + token * stride_xn + h * stride_xh + d
    x1 = tl.load(first, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=valid, other=0.0).to(tl.float32)
    out = out_ptr + token * stride_on + h * stride_oh + d
    tl.store(out, x1 * c1 - x2 * s1, mask=valid)
    tl.store(out + HALF, x2 * c2 + x1 * s2, mask=valid)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, stride_qn, stride_qh,
                   stride_kn, stride_kh, stride_cn, stride_qon, stride_qoh, stride_kon, stride_koh,
                   n_q_heads, n_k_heads, HALF, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dv = d < HALF
    row = token * stride_cn + d
    c1 = tl.load(cos_ptr + row, mask=dv, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF, mask=dv, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row, mask=dv, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF, mask=dv, other=0.0).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, stride_qn, stride_qh, stride_qon, stride_qoh, n_q_heads, token,
            c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, k_out_ptr, stride_kn, stride_kh, stride_kon, stride_koh, n_k_heads, token,
            c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_HALF)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE; q [N, H, D], k [N, Hkv, D] (any row and head strides), cos/sin [N, D]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=torch.result_type(q, cos), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.result_type(k, cos), device=k.device)
    half = dim // 2
    _rotary_kernel[(n,)](
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        heads, kv_heads, half, BLOCK_HQ=_pow2(heads), BLOCK_HK=_pow2(kv_heads),
        BLOCK_HALF=_pow2(half))
    return q_out, k_out


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- SiLU and multiply ----
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=valid, other=0.0)
    g = gate.to(tl.float32)
    # silu rounded to the input dtype before the product, as the reference's F.silu(gate) * up.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, silu.to(tl.float32) * up.to(tl.float32),
             mask=valid)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, with gate and up concatenated on the last dimension."""
    width = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(width))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
        x2, out, width, x2.stride(0), out.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], width)


# ---- KV store ----
# How the cache holds values: as the model's dtype, or quantized (kernels/kv_quant.py).
_PLAIN, _INT8, _FP8 = 0, 1, 2
_QUANT_CODE = {torch.int8: _INT8, torch.float8_e4m3fn: _FP8}


@triton.jit
def _store_rows(x_ptr, cache_ptr, scale_ptr, token, slot, heads, n_heads, d, valid, stride_xn,
                stride_xh, stride_cs, stride_ch, stride_ss, stride_sh, QUANT: tl.constexpr,
                QMAX: tl.constexpr):
    """One token's heads into its cache slot; quantized, each head row with its own scale."""
    h = heads[:, None]
    x = tl.load(x_ptr + token * stride_xn + h * stride_xh + d, mask=valid, other=0.0)
    dst = cache_ptr + slot * stride_cs + h * stride_ch + d
    if QUANT == 0:
        tl.store(dst, x, mask=valid)
    else:
        xf = x.to(tl.float32)
        scale = tl.max(tl.abs(xf), axis=1) / QMAX
        y = xf * tl.where(scale > 0.0, 1.0 / scale, 0.0)[:, None]
        if QUANT == 1:
            y = tl.where(y >= 0.0, tl.floor(y + 0.5), -tl.floor(0.5 - y))  # half away from 0
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=valid)
        tl.store(scale_ptr + slot * stride_ss + heads * stride_sh, scale, mask=heads < n_heads)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh, stride_cs, stride_ch, stride_ss,
                     stride_sh, n_heads, dim, QUANT: tl.constexpr, QMAX: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)[None, :]
    valid = (heads[:, None] < n_heads) & (d < dim)
    _store_rows(k_ptr, k_cache_ptr, k_scale_ptr, token, slot, heads, n_heads, d, valid,
                stride_kn, stride_kh, stride_cs, stride_ch, stride_ss, stride_sh, QUANT, QMAX)
    _store_rows(v_ptr, v_cache_ptr, v_scale_ptr, token, slot, heads, n_heads, d, valid,
                stride_vn, stride_vh, stride_cs, stride_ch, stride_ss, stride_sh, QUANT, QMAX)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | QuantizedCache,
    v_cache: torch.Tensor | QuantizedCache,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([N, Hkv, D]) into flat cache slots ([slots, Hkv, D]), quantized
    when the cache is a QuantizedCache."""
    n, heads, dim = k.shape
    if n == 0:
        return
    cache = _CacheArgs.of(k_cache, v_cache)
    if not cache.quant:
        k, v = k.to(cache.k.dtype), v.to(cache.v.dtype)
    k, v = _unit_last(k), _unit_last(v)
    if cache.k.stride() != cache.v.stride() or cache.k.stride(-1) != 1:
        raise ValueError("store_kv needs the K and V caches in the same layout with contiguous "
                         "head rows: allocate both as one [slots, Hkv, D] tensor each.")
    _store_kv_kernel[(n,)](
        k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, slot_mapping, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cache.k.stride(0), cache.k.stride(1),
        cache.stride_ss, cache.stride_sh, heads, dim, QUANT=cache.quant, QMAX=cache.qmax,
        BLOCK_H=_pow2(heads), BLOCK_D=_pow2(dim))


class _CacheArgs:
    """A layer's K/V caches as kernel arguments: the value tensors and, quantized, their scales
    (for a plain cache the scale arguments are unused placeholders)."""

    def __init__(self, k, v, k_scale, v_scale, quant: int, qmax: float) -> None:
        self.k, self.v, self.k_scale, self.v_scale = k, v, k_scale, v_scale
        self.quant, self.qmax = quant, qmax
        self.stride_ss, self.stride_sh = (k_scale.stride(0), k_scale.stride(1)) if quant else (0, 0)

    @classmethod
    def of(cls, k_cache, v_cache) -> _CacheArgs:
        if isinstance(k_cache, QuantizedCache):
            if k_cache.scale.stride() != v_cache.scale.stride():
                raise ValueError("The K and V scales need the same layout: allocate both as one "
                                 "[slots, Hkv] float32 tensor each.")
            return cls(k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
                       _QUANT_CODE[k_cache.dtype], QMAX[k_cache.dtype])
        return cls(k_cache, v_cache, k_cache, v_cache, _PLAIN, 1.0)


# ---- paged attention ----
@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, mass_ptr,
                   part_ptr, m_ptr, l_ptr, row_ptr, slots_ptr, mask_ptr, scale, n_keys,
                   keys_per_split, n_splits, n_heads, dim, group, stride_qn, stride_qh, stride_cs,
                   stride_ch, stride_ss, stride_sh, stride_sb, stride_mb, stride_massb,
                   stride_massh, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
                   RETURN_MASS: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One decode query's `group` query heads that share KV head `kv_head`, over its keys (or,
    with SPLIT, over split `program_id(2)` of them, flash-decoding style).

    The query heads of one KV head are the rows of one tile, so every key is read once per KV
    head (grouped-query attention without repeating K/V). Online softmax over key blocks. With
    SPLIT each split writes its normalised partial output and its running max and sum for
    _combine_kernel. With RETURN_MASS (never split) a second pass writes each key's probability
    summed over the group. With QUANT the cache holds int8/fp8 rows with a scale each
    (kernels/kv_quant.py), dequantized as they are loaded.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    lo = split * keys_per_split
    hi = tl.minimum(n_keys, lo + keys_per_split)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_valid = g < group
    d_valid = d < dim
    row = tl.load(row_ptr + b)
    q_off = row * stride_qn + (kv_head * group + g[:, None]) * stride_qh + d[None, :]
    q_valid = g_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + q_off, mask=q_valid, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        s, keep, kv_off, sc_off, in_range = _decode_scores(
            q, k_cache_ptr, k_scale_ptr, slots_ptr, mask_ptr, b, kv_head, start, scale, hi, d,
            d_valid, stride_cs, stride_ch, stride_ss, stride_sh, stride_sb, stride_mb, HAS_MASK,
            QUANT, PRECISION, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no key allowed yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_rows(v_cache_ptr, kv_off, in_range[:, None] & d_valid[None, :], v_scale_ptr,
                       sc_off, in_range, q, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SPLIT:
        part = (b * n_heads + kv_head * group + g) * n_splits + split
        tl.store(part_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=q_valid)
        tl.store(m_ptr + part, m_i, mask=g_valid)
        tl.store(l_ptr + part, l_i, mask=g_valid)
    else:
        tl.store(out_ptr + q_off, out, mask=q_valid)
    if RETURN_MASS:
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        for start in range(0, n_keys, BLOCK_N):
            s, keep, kv_off, sc_off, in_range = _decode_scores(
                q, k_cache_ptr, k_scale_ptr, slots_ptr, mask_ptr, b, kv_head, start, scale,
                n_keys, d, d_valid, stride_cs, stride_ch, stride_ss, stride_sh, stride_sb,
                stride_mb, HAS_MASK, QUANT, PRECISION, BLOCK_N)
            p = tl.exp(s - m_safe[:, None]) / l_safe[:, None]
            p = tl.where(g_valid[:, None], p, 0.0)
            n = start + tl.arange(0, BLOCK_N)
            tl.store(mass_ptr + b * stride_massb + kv_head * stride_massh + n,
                     tl.sum(p, axis=0), mask=in_range)


@triton.jit
def _decode_scores(q, k_cache_ptr, k_scale_ptr, slots_ptr, mask_ptr, b, kv_head, start, scale,
                   n_keys, d, d_valid, stride_cs, stride_ch, stride_ss, stride_sh, stride_sb,
                   stride_mb, HAS_MASK: tl.constexpr, QUANT: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scaled scores [G, BLOCK_N] of keys start.. (-inf where masked), and where their rows and
    (quantized) scales are."""
    n = start + tl.arange(0, BLOCK_N)
    in_range = n < n_keys
    keep = in_range
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + b * stride_mb + n, mask=in_range, other=0) != 0)
    slot = tl.load(slots_ptr + b * stride_sb + n, mask=in_range, other=0)
    kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    sc_off = slot * stride_ss + kv_head * stride_sh
    k = _load_rows(k_cache_ptr, kv_off, in_range[:, None] & d_valid[None, :], k_scale_ptr, sc_off,
                   in_range, q, QUANT)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(keep[None, :], s, float("-inf"))
    return s, keep, kv_off, sc_off, in_range


@triton.jit
def _load_rows(cache_ptr, kv_off, valid, scale_ptr, sc_off, row_valid, like,
               QUANT: tl.constexpr):
    """Cached K or V rows [BLOCK_N, BLOCK_D] in `like`'s dtype, dequantized when QUANT."""
    x = tl.load(cache_ptr + kv_off, mask=valid, other=0.0)
    if QUANT != 0:
        sc = tl.load(scale_ptr + sc_off, mask=row_valid, other=0.0)
        x = (x.to(tl.float32) * sc[:, None]).to(like.dtype)
    return x


@triton.jit
def _combine_kernel(out_ptr, part_ptr, m_ptr, l_ptr, row_ptr, n_splits, n_heads, dim, stride_qn,
                    stride_qh, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One decode query head's output from its splits: each split's normalised partial output
    weighted by its softmax sum rescaled to the common maximum."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_valid = sp < n_splits
    part = (b * n_heads + head) * n_splits + sp
    m = tl.load(m_ptr + part, mask=s_valid, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l > 0.0, tl.exp(m - m_max) * l, 0.0)
    o = tl.load(part_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_valid[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total == 0.0, 1.0, total)
    row = tl.load(row_ptr + b)
    tl.store(out_ptr + row * stride_qn + head * stride_qh + d, out, mask=d < dim)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, mass_ptr,
                    slots_ptr, mask_ptr, scale, row0, n_queries, n_keys, mass_from, dim, group,
                    stride_qn, stride_qh, stride_cs, stride_ch, stride_ss, stride_sh, stride_mq,
                    stride_massh, HAS_MASK: tl.constexpr, RETURN_MASS: tl.constexpr,
                    QUANT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tile of one chunk's queries for one query head over the chunk's keys.

    Without a mask the chunk is a fresh causal prefill (query i sits at position
    n_keys - n_queries + i) and key blocks past the tile's last query are skipped. With
    RETURN_MASS a second pass adds each key's probabilities from queries mass_from.. into its KV
    head's row (atomically: every query tile and query head of the group adds to it).
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    i_valid = i < n_queries
    d_valid = d < dim
    q_off = (row0 + i[:, None]) * stride_qn + head * stride_qh + d[None, :]
    q_valid = i_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + q_off, mask=q_valid, other=0.0)
    end = n_keys
    if not HAS_MASK:
        end = tl.minimum(n_keys, n_keys - n_queries + (tile + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, end, BLOCK_N):
        s, kv_off, sc_off, kv_valid, j_valid = _prefill_scores(
            q, k_cache_ptr, k_scale_ptr, slots_ptr, mask_ptr, kv_head, start, scale, i, i_valid,
            n_queries, n_keys, d, d_valid, stride_cs, stride_ch, stride_ss, stride_sh, stride_mq,
            HAS_MASK, QUANT, PRECISION, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_rows(v_cache_ptr, kv_off, kv_valid, v_scale_ptr, sc_off, j_valid, q, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out_ptr + q_off, acc / l_safe[:, None], mask=q_valid)
    if RETURN_MASS:
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        counted = i_valid & (i >= mass_from)
        for start in range(0, end, BLOCK_N):
            s, kv_off, sc_off, kv_valid, j_valid = _prefill_scores(
                q, k_cache_ptr, k_scale_ptr, slots_ptr, mask_ptr, kv_head, start, scale, i,
                i_valid, n_queries, n_keys, d, d_valid, stride_cs, stride_ch, stride_ss,
                stride_sh, stride_mq, HAS_MASK, QUANT, PRECISION, BLOCK_N)
            p = tl.exp(s - m_safe[:, None]) / l_safe[:, None]
            p = tl.where(counted[:, None], p, 0.0)
            j = start + tl.arange(0, BLOCK_N)
            tl.atomic_add(mass_ptr + kv_head * stride_massh + j, tl.sum(p, axis=0),
                          mask=j < n_keys)


@triton.jit
def _prefill_scores(q, k_cache_ptr, k_scale_ptr, slots_ptr, mask_ptr, kv_head, start, scale, i,
                    i_valid, n_queries, n_keys, d, d_valid, stride_cs, stride_ch, stride_ss,
                    stride_sh, stride_mq, HAS_MASK: tl.constexpr, QUANT: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scaled scores [BLOCK_M, BLOCK_N] of keys start.. (-inf where not allowed), and where the
    keys' rows are in the cache."""
    j = start + tl.arange(0, BLOCK_N)
    j_valid = j < n_keys
    slot = tl.load(slots_ptr + j, mask=j_valid, other=0)
    kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    sc_off = slot * stride_ss + kv_head * stride_sh
    kv_valid = j_valid[:, None] & d_valid[None, :]
    k = _load_rows(k_cache_ptr, kv_off, kv_valid, k_scale_ptr, sc_off, j_valid, q, QUANT)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_MASK:
        allowed = tl.load(mask_ptr + i[:, None] * stride_mq + j[None, :],
                          mask=i_valid[:, None] & j_valid[None, :], other=0) != 0
    else:
        allowed = (j[None, :] <= n_keys - n_queries + i[:, None]) & j_valid[None, :]
    return tl.where(allowed, s, float("-inf")), kv_off, sc_off, kv_valid, j_valid


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat batch of queries ([N, H, D]) over the paged cache -> [N, H, D]."""
    out = torch.empty_like(q)
    if meta.decode_token_index is not None:
        decode_attention(q, k_cache, v_cache, meta, scale, out)
    for chunk in meta.prefills:
        prefill_attention(q, k_cache, v_cache, chunk, scale, out)
    return out


def paged_attention_mass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> tuple[torch.Tensor, AttentionMass]:
    """paged_attention plus the attention mass each key received (see AttentionMass)."""
    out = torch.empty_like(q)
    decode_mass = None
    if meta.decode_token_index is not None:
        decode_mass = decode_attention(q, k_cache, v_cache, meta, scale, out, return_mass=True)
    prefill_mass = [prefill_attention(q, k_cache, v_cache, chunk, scale, out, return_mass=True)
                    for chunk in meta.prefills]
    return out, AttentionMass(decode_mass, prefill_mass)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, out: torch.Tensor, return_mass: bool = False, splits: int | None = None,
) -> torch.Tensor | None:
    """Attention of the decode rows of q (meta.decode_token_index) written into the same rows of
    `out`; with `return_mass`, also each key's softmax probability summed over the query heads of
    its KV head ([B, Hkv, T] float32, 0 at masked keys). `splits` overrides how many parts each
    query's keys are split into (see _decode_splits; the mass pass always runs unsplit)."""
    cache = _CacheArgs.of(k_cache, v_cache)
    k_cache = cache.k
    _check_attention_inputs(q, k_cache, cache.v, out)
    rows, slots = meta.decode_token_index, _unit_last(meta.decode_slots)
    batch, n_keys = slots.shape
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if return_mass:
        splits = 1
    elif splits is None:
        splits = _decode_splits(batch, kv_heads, n_keys, q.device)
    keys_per_split = triton.cdiv(triton.cdiv(n_keys, splits), _DECODE_BLOCK_N) * _DECODE_BLOCK_N
    splits = triton.cdiv(n_keys, keys_per_split)  # no split left without keys
    block_d = _pow2(dim, 16)
    mask = (None if meta.decode_mask is None
            else _unit_last(meta.decode_mask.reshape(batch, n_keys)))
    mass = (torch.empty((batch, kv_heads, n_keys), dtype=torch.float32, device=q.device)
            if return_mass else None)
    part = m = l = out  # placeholders the unsplit kernel never touches
    if splits > 1:
        part = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
        m, l = torch.empty((2, batch, heads, splits), dtype=torch.float32, device=q.device)
    mass_arg = mass if mass is not None else out
    mask_arg = mask if mask is not None else slots
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, cache.v, cache.k_scale, cache.v_scale, out, mass_arg, part, m, l, rows, slots,
        mask_arg, scale, n_keys, keys_per_split, splits, heads, dim, group, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), cache.stride_ss, cache.stride_sh,
        slots.stride(0), mask_arg.stride(0), mass_arg.stride(0), mass_arg.stride(1),
        HAS_MASK=mask is not None, SPLIT=splits > 1, RETURN_MASS=return_mass, QUANT=cache.quant,
        PRECISION=_dot_precision(q.dtype), BLOCK_G=_pow2(group, 16), BLOCK_N=_DECODE_BLOCK_N,
        BLOCK_D=block_d)
    if splits > 1:
        _combine_kernel[(batch, heads)](out, part, m, l, rows, splits, heads, dim, q.stride(0),
                                        q.stride(1), BLOCK_S=_pow2(splits), BLOCK_D=block_d)
    return mass


def _decode_splits(batch: int, kv_heads: int, n_keys: int, device: torch.device) -> int:
    """Key splits per decode query: enough programs to fill the GPU twice over when the batch
    alone does not (batch 1 of a 3-KV-head model is 3 programs on a 100+ SM GPU), but never
    below _MIN_SPLIT_KEYS keys per split, where the combine step would cost more than it saves."""
    units = (torch.cuda.get_device_properties(device).multi_processor_count
             if device.type == "cuda" else _INTERPRETER_UNITS)
    wanted = triton.cdiv(2 * units, batch * kv_heads)
    return max(1, min(wanted, n_keys // _MIN_SPLIT_KEYS))


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk,
    scale: float, out: torch.Tensor, return_mass: bool = False,
) -> torch.Tensor | None:
    """Attention of one chunk's query rows (chunk.start:chunk.end) written into `out`; with
    `return_mass`, also each key's probability summed over the query heads of its KV head and
    over the chunk's queries, or its last `chunk.mass_rows` ([Hkv, context] float32)."""
    cache = _CacheArgs.of(k_cache, v_cache)
    k_cache = cache.k
    _check_attention_inputs(q, k_cache, cache.v, out)
    n_queries, n_keys = chunk.end - chunk.start, chunk.slots.shape[0]
    slots = chunk.slots.contiguous()
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    mask = None if chunk.mask is None else _unit_last(chunk.mask)
    mask_arg = mask if mask is not None else slots.view(1, -1)
    mass = (torch.zeros((kv_heads, n_keys), dtype=torch.float32, device=q.device)
            if return_mass else None)
    mass_arg = mass if mass is not None else out[0]
    mass_from = n_queries - (chunk.mass_rows if chunk.mass_rows is not None else n_queries)
    block = prefill_block(q.dtype)
    _prefill_kernel[(triton.cdiv(n_queries, block), heads)](
        q, k_cache, cache.v, cache.k_scale, cache.v_scale, out, mass_arg, slots, mask_arg, scale,
        chunk.start, n_queries, n_keys, mass_from, dim, heads // kv_heads, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), cache.stride_ss, cache.stride_sh,
        mask_arg.stride(0), mass_arg.stride(0), HAS_MASK=mask is not None,
        RETURN_MASS=return_mass, QUANT=cache.quant, PRECISION=_dot_precision(q.dtype),
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=_pow2(dim, 16))
    return mass


def prefill_block(dtype: torch.dtype) -> int:
    """The prefill kernel's query and key tile size for a dtype."""
    return _PREFILL_BLOCK.get(dtype, _PREFILL_BLOCK_DEFAULT)


def _check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: torch.Tensor) -> None:
    """The kernels index q/out and both caches with one set of strides and a unit last stride."""
    if q.stride() != out.stride() or q.stride(-1) != 1:
        raise ValueError("paged attention needs q and out with the same strides and contiguous "
                         "head rows: pass q.contiguous() and torch.empty_like(q).")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the K and V caches in the same layout with "
                         "contiguous head rows: allocate both as one [slots, Hkv, D] tensor each.")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"paged attention needs the {q.shape[1]} query heads to be a multiple "
                         f"of the {k_cache.shape[1]} KV heads.")
