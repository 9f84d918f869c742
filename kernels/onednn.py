"""Linear layers through oneDNN with pre-packed weights: the fast float32 matmul on x86 CPUs.

PyTorch's default CPU matmul goes through MKL, which on some CPUs (AMD EPYC here) runs a slow
code path; oneDNN's packed weights were 2-5x faster per layer at batch 1-64 on this machine.
The ops are private aten ops (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`, the
ones Inductor's CPU freezing pass uses), so they are detected and checked at run time.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The batch-size hint picks oneDNN's weight layout; 16 measured best from batch 1 to 1,000.
_LAYOUT_HINT = 16


def prepare_linear(weight: torch.Tensor) -> torch.Tensor:
    """The weight ([out, in], float32, CPU) re-laid out for oneDNN."""
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
def available() -> bool:
    """Whether this PyTorch build has the ops and they agree with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen)
        b = torch.randn(24, generator=gen)
        x = torch.randn(3, 40, generator=gen)
        got = linear(x, prepare_linear(w), b)
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4))
