"""A quantized KV cache: int8 or fp8 (e4m3) values with a float32 scale per token and KV head.

Each cached key or value row (one token, one KV head: head_dim numbers) is stored as
round(x / scale) with scale = max|x| / QMAX, so every head of every token gets its own scale:
no calibration pass, and an outlier head or token costs precision only for itself. With head
dim 64 that is 64 + 4 bytes per row against 128 for bfloat16 and 256 for float32.

Reads dequantize on the fly (the reference gathers and dequantizes; the Triton kernels scale the
loaded tiles in registers). Rounding is half away from zero in both, so the two store the same
bytes. The tensors are plain torch tensors, so the cache can be copied byte for byte (as
uint8) where torch has no copy kernel for float8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass
class QuantizedCache:
    """One layer's K or V cache: values [slots, Hkv, D] (int8 / float8) and scales [slots, Hkv]."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def storage_dtype(name: str) -> torch.dtype | None:
    """The element type of a KV cache dtype name ("int8", "fp8"); None for "auto"."""
    return STORAGE.get(name)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the last dimension to (values in `dtype`, float32 scale per row)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / QMAX[dtype]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = xf * inv.unsqueeze(-1)
    if dtype == torch.int8:
        # Half away from zero, as the Triton store kernel rounds (torch.round is half to even).
        return (scaled.abs() + 0.5).floor().copysign(scaled).to(torch.int8), scale
    return scaled.to(dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values * scale per row, in `dtype`."""
    return (data.float() * scale.unsqueeze(-1)).to(dtype)


def store(cache: QuantizedCache, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize new rows ([N, Hkv, D]) into the cache's slots."""
    data, scale = quantize(x, cache.data.dtype)
    as_bytes(cache.data).index_copy_(0, slot_mapping, as_bytes(data))
    cache.scale.index_copy_(0, slot_mapping, scale)


def gather(cache: QuantizedCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized rows at `slots` (any shape) -> slots.shape + [Hkv, D] in `dtype`."""
    flat = slots.reshape(-1)
    data = as_bytes(cache.data).index_select(0, flat).view(cache.data.dtype)
    rows = dequantize(data, cache.scale.index_select(0, flat), dtype)
    return rows.view(*slots.shape, *cache.data.shape[1:])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8: torch copies and indexes bytes for every dtype (float8 has no
    CPU index_copy kernel)."""
    return t.view(torch.uint8)
