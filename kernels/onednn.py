"""Linear layers through oneDNN with pre-packed weights: the fast float32 and bfloat16 matmul on
x86 CPUs.

PyTorch's default CPU matmul goes through MKL, which on some CPUs (AMD EPYC) runs a slow code
path; oneDNN's packed weights were 2-5x faster per layer at batch 1-64 there. In bfloat16 plain
F.linear does not pack the weight either: on a Xeon with AVX512-BF16 / AMX, oneDNN-packed
bfloat16 was 1.3-1.6x faster than bfloat16 F.linear at 1-64 rows, and 2-4x faster than float32
from 4 rows up (cold-cache weights, the demo model's shapes).
The ops are private aten ops (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`, the
ones Inductor's CPU freezing pass uses), so they are detected and checked at run time, per dtype.

On that Xeon, float32 F.linear (MKL) beat packed oneDNN at 1 row for 3 of the 4 layer shapes
(batch-1 decode 15.4 vs 13.3 tok/s, 1 thread; oneDNN 1.2x ahead at 16 concurrent), but MKL
cannot read the packed layout and oneDNN on the plain layout was no faster than MKL from 4 rows
up: a per-shape choice at 1 row would hold every float32 weight twice, so batch 1 stays here.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The batch-size hint picks oneDNN's weight layout; 16 measured best from batch 1 to 1,000.
_LAYOUT_HINT = 16
# The dtypes the packed ops may run, each with its self-check's tolerance relative to the largest
# output: float32 agrees with F.linear to accumulation order; bfloat16 rounds inputs and output to
# 8 significant bits (2^-9 relative each), so a few 2^-9 of the output's scale is agreement.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DTYPES = tuple(_CHECK_TOLERANCE)


def prepare_linear(weight: torch.Tensor) -> torch.Tensor:
    """The weight ([out, in], float32 or bfloat16, CPU) re-laid out for oneDNN."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _LAYOUT_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with a weight from prepare_linear.

    The rows are padded up to a bucket (padded_rows): oneDNN builds and caches a primitive per
    input shape (1,024 by default), and a server whose steps carry every token count from 1 to
    2,048 overflowed that cache, rebuilding primitives and fragmenting the heap without bound
    (1.1 GB more resident after one sweep of 300 row counts, 0.8 GB more after a second sweep
    of the same counts; with buckets: flat).
    """
    rows = x.shape[0]
    padded = padded_rows(rows) if x.dim() == 2 else rows
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def padded_rows(rows: int) -> int:
    """The bucket a matmul of `rows` rows runs at: exact up to 16 (decode batches, where a padded
    row costs most), then steps of 8, 32, 128 and 512 rows, so that at most about 55 distinct
    shapes reach oneDNN per weight for steps of up to 2,048 tokens, at most 1/8 extra rows."""
    for limit, step in ((16, 1), (128, 8), (512, 32), (2048, 128)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 512) * 512


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch build has the ops for `dtype` and they agree with F.linear in float32
    on the same (rounded) inputs."""
    if dtype not in _CHECK_TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not _native_bf16():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=gen).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    x = torch.randn(3, 40, generator=gen).to(dtype)
    try:
        got = linear(x, prepare_linear(w), b)
    except (AttributeError, RuntimeError):
        return False
    want = F.linear(x.float(), w.float(), b.float())
    error = (got.float() - want).abs().max()
    return got.dtype == dtype and bool(error <= _CHECK_TOLERANCE[dtype] * want.abs().max())


def _native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 with the CPU's own instructions (AVX512-BF16 / AMX, or their
    AVX512 emulation): elsewhere it refuses or falls to slow reference code, where bfloat16
    F.linear is the better choice. PyTorch gates its own oneDNN bfloat16 paths on this."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
