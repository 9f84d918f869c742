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
    """x @ weight.T + bias with a weight from prepare_linear."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


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
