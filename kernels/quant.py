"""Weight-only int8 / int4 quantization: the format, GGUF block import, and the quantized linear.

A `QuantizedWeight` holds a [out, in] matrix as integer codes and per-group scales:
int8 is symmetric (w = code * scale, per output channel or per group of inputs), int4 is
asymmetric (w = code * scale + min, codes 0..15, two per byte) in groups of 32 / 64 / 128
inputs, the layout of llama.cpp's Q4_1 blocks and gpt-fast's int4. GGUF Q8_0 / Q4_0 / Q4_1
blocks convert to it code for code, so a quantized file is used as it is, not re-quantized.

Matmuls: on the CPU PyTorch's packed ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
when this build has them and they pass a self-check (detected at run time, like kernels/onednn.py);
their fast path wants bfloat16 activations, so a float32 input is cast down and the result back
up. Otherwise the weight is dequantized and multiplied (`QuantizedWeight.linear`), the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

GROUP_SIZES = (32, 64, 128)
# The packed CPU ops take activations and scales in this dtype: torch 2.13's CPU build
# vectorises them for bfloat16 only, and float32 inputs were slower than float32 oneDNN itself.
PACKED_COMPUTE_DTYPE = torch.bfloat16
GGUF_BLOCK = 32
_GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
GGUF_KINDS = tuple(_GGUF_BLOCK_BYTES)


@dataclass
class QuantizedWeight:
    """A [out, in] weight as integer codes and per-group scales; `dequantize` is the reference.

    codes: int8 [out, padded_in] (bits 8) or uint8 [out, padded_in // 2], two 4-bit codes per
    byte, the even input in the low nibble (bits 4). scales (and, for int4, mins): float32
    [out, padded_in // group_size]. Inputs are zero-padded to a whole number of groups.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def padded_in(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def nbytes(self) -> int:
        parts = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def to(self, device: torch.device) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins.to(device)
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), mins, self.bits,
                               self.group_size, self.in_features)

    def int_codes(self) -> torch.Tensor:
        """The codes one per element ([out, padded_in]; int8, or uint8 0..15 for int4)."""
        if self.bits == 8:
            return self.codes
        return torch.stack((self.codes & 15, self.codes >> 4), dim=-1).reshape(
            self.out_features, self.padded_in)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] the codes stand for (computed in float32)."""
        groups = self.scales.shape[1]
        codes = self.int_codes().float().view(self.out_features, groups, self.group_size)
        w = codes * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.out_features, self.padded_in)[:, : self.in_features].to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T + bias by dequantizing first: the fallback and the oracle of the packed ops."""
        return F.linear(x, self.dequantize(x.dtype), bias)


# ---- quantizing float weights ----
def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8, per output channel (group_size None) or per group of inputs."""
    w, group = _grouped(weight, group_size)
    scales = w.abs().amax(dim=-1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group
    codes = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(codes.reshape(w.shape[0], -1), scales, None, 8, group, weight.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` inputs: w ~ code * scale + min, codes 0..15."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not supported: use 32, 64 or 128.")
    w, group = _grouped(weight, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round((w - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(pack_nibbles(codes.reshape(w.shape[0], -1)), scales, low, 4, group,
                           weight.shape[1])


def _grouped(weight: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, int]:
    """The float32 weight as [out, groups, group], zero-padded to whole groups."""
    out, inp = weight.shape
    group = group_size or inp
    pad = -inp % group
    w = weight.detach().float()
    if pad:
        w = F.pad(w, (0, pad))
    return w.reshape(out, -1, group), group


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [out, k] -> [out, k // 2], the even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


# ---- GGUF blocks ----
def from_gguf_blocks(kind: str, raw: np.ndarray, in_features: int) -> QuantizedWeight:
    """GGUF Q8_0 / Q4_0 / Q4_1 rows ([out, bytes] uint8, as gguf's reader maps them) code for
    code: Q8_0 becomes int8 in groups of 32, Q4_0 / Q4_1 int4 in groups of 32 (Q4_0's
    w = d * (q - 8) is stored as q * d + (-8 d), exact in float32)."""
    if kind not in _GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF block type {kind} is not importable: use {', '.join(GGUF_KINDS)}.")
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, _GGUF_BLOCK_BYTES[kind])
    d = _fp16(blocks[..., 0:2])
    if kind == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return QuantizedWeight(torch.from_numpy(codes), torch.from_numpy(d), None, 8, GGUF_BLOCK,
                               in_features)
    if kind == "Q4_1":
        mins, qs = _fp16(blocks[..., 2:4]), blocks[..., 4:]
    else:
        mins, qs = -8.0 * d, blocks[..., 2:]
    # A block's element j sits in the low nibble of byte j, element j + 16 in its high nibble.
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(rows, -1)
    packed = pack_nibbles(torch.from_numpy(np.ascontiguousarray(codes)))
    return QuantizedWeight(packed, torch.from_numpy(d), torch.from_numpy(mins), 4, GGUF_BLOCK,
                           in_features)


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack weights along output rows (fused Q/K/V, gate/up); None when their formats differ."""
    first = weights[0]
    same = all((w.bits, w.group_size, w.in_features, w.mins is None)
               == (first.bits, first.group_size, first.in_features, first.mins is None)
               for w in weights)
    if not same:
        return None
    mins = None if first.mins is None else torch.cat([w.mins for w in weights])
    return QuantizedWeight(torch.cat([w.codes for w in weights]),
                           torch.cat([w.scales for w in weights]), mins, first.bits,
                           first.group_size, first.in_features)


# ---- packed CPU ops ----
class PackedInt8:
    """Per-channel int8 in `_weight_int8pack_mm`'s layout (codes as they are, scales in bf16)."""

    def __init__(self, q: QuantizedWeight) -> None:
        self.codes = q.codes.contiguous()
        self.scales = q.scales[:, 0].to(PACKED_COMPUTE_DTYPE)
        self.in_features = q.in_features
        self.nbytes = self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(PACKED_COMPUTE_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.codes, self.scales).to(x.dtype)
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class PackedInt4:
    """Group-wise int4 in `_weight_int4pack_mm_for_cpu`'s layout: w = (q - 8) * scale + zero."""

    def __init__(self, q: QuantizedWeight) -> None:
        codes = q.int_codes().to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # code * scale + min == (code - 8) * scale + (min + 8 * scale)
        zeros = q.mins + 8.0 * q.scales
        self.scales_zeros = torch.stack((q.scales, zeros), dim=-1).transpose(0, 1).contiguous().to(
            PACKED_COMPUTE_DTYPE)
        self.group_size, self.in_features, self.pad = q.group_size, q.in_features, \
            q.padded_in - q.in_features
        self.nbytes = (self.packed.numel() * self.packed.element_size()
                       + self.scales_zeros.numel() * self.scales_zeros.element_size())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(PACKED_COMPUTE_DTYPE)
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # zero inputs meet the padded weight columns
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size,
                                                       self.scales_zeros).to(x.dtype)
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def prepare_packed(q: QuantizedWeight) -> QuantizedWeight | PackedInt8 | PackedInt4:
    """The packed form of a CPU weight when this build's ops handle it, else the weight itself
    (whose `linear` dequantizes)."""
    if q.codes.device.type != "cpu":
        return q
    # Shapes outside these the ops refuse (int4: N % 16) or, worse, crash on (int8 with
    # K % 16 != 0 and more than one row segfaults in torch 2.13): those keep the fallback.
    if (q.bits == 8 and q.group_size == q.in_features and q.in_features % 16 == 0
            and int8_packed_available()):
        return PackedInt8(q)
    if q.bits == 4 and q.out_features % 16 == 0 and int4_packed_available():
        try:
            return PackedInt4(q)
        except RuntimeError:  # a shape the packing kernel does not take
            return q
    return q


def _self_check(make, bits: int) -> bool:
    """Whether a packed op exists and agrees with the dequantize reference on random data."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen)
    x = torch.randn(3, 96, generator=gen)
    q = quantize_int8(w) if bits == 8 else quantize_int4(w, 32)
    try:
        got = make(q).linear(x)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    want = q.linear(x)
    # bfloat16 activations and scales: ~3 significant digits, so compare to the output's scale.
    return bool(((got - want).abs().max() <= 2e-2 * want.abs().max()).item())


@functools.cache
def int8_packed_available() -> bool:
    """Whether `_weight_int8pack_mm` exists here and passes the self-check."""
    return _self_check(PackedInt8, 8)


@functools.cache
def int4_packed_available() -> bool:
    """Whether `_weight_int4pack_mm_for_cpu` exists here and passes the self-check."""
    return _self_check(PackedInt4, 4)
