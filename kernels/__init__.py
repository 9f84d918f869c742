"""Attention, norm and rotary ops: torch references behind one dispatch point.

Every op the model runs is looked up here, so a faster implementation (on the CPU: oneDNN linear
layers in float32, bfloat16 ones through a C tile kernel where the CPU has AVX512-BF16 and no
AMX, or AVX2 (kernels/cpu_linear.py; else oneDNN where it runs bfloat16 natively), decode
attention, RMSNorm, rotary and SwiGLU from small C kernels (kernels/cpu_kernels.py); Triton on
CUDA) can replace the reference for one device and dtype without the model knowing.
`SERVESCOPE_KERNELS=reference|onednn|triton` forces one backend everywhere. Each table's
`prepare_linear` / `linear` also take weight-only quantized weights (kernels/quant.py): the
reference dequantizes them per call, the oneDNN table runs int4 and per-channel int8 through the
C kernels of kernels/cpu_quant.py where the CPU has AVX512-BF16 or AVX2, else PyTorch's packed
int8 / int4 ops where they exist. `prepare_compact_linear` is `prepare_linear` for weights that
need not multiply exactly (a speculative draft's): int4 where the table has an int4 kernel of its
own.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace

import torch

from kernels import (
    cpu_draft,
    cpu_kernels,
    cpu_layers,
    cpu_linear,
    cpu_quant,
    onednn,
    quant,
    reference,
)
from kernels.metadata import AttentionMass, AttentionMetadata, PrefillChunk

OPS = ("prepare_linear", "linear", "rms_norm", "rotary", "silu_and_mul", "store_kv",
       "paged_attention", "paged_attention_mass", "prepare_decode_stack", "softmax_topk",
       "prepare_draft_level")


def _table(name: str, prepare_quantized=None, int4_kernel=None, **overrides) -> SimpleNamespace:
    ops = {op: getattr(reference, op) for op in OPS} | overrides
    ops["prepare_linear"], ops["linear"] = _quant_aware(ops["prepare_linear"], ops["linear"],
                                                        prepare_quantized)
    ops["prepare_compact_linear"] = _compact(ops["prepare_linear"], int4_kernel)
    return SimpleNamespace(name=name, **ops)


def _quant_aware(prepare, linear, prepare_quantized):
    """prepare_linear / linear that also take a quantized weight, so the model never asks which
    kind it holds: float tensors go to the table's own ops, quantized ones to their own matmul."""

    def prepare_any(weight):
        if isinstance(weight, quant.QuantizedWeight):
            return weight if prepare_quantized is None else prepare_quantized(weight)
        return prepare(weight)

    def linear_any(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return linear(x, weight, bias)
        return weight.linear(x, bias)

    return prepare_any, linear_any


def _compact(prepare_any, int4_kernel):
    """prepare_compact_linear: a float weight as int4 (groups of COMPACT_GROUP) where the table
    has an int4 kernel of its own that takes it (`int4_kernel`: the kernel's weight, or None),
    else as prepare_linear has it. For weights whose every byte is read each step and whose
    products need not be exact: a speculative draft's (the target verifies its proposals, so a
    draft in int4 can only propose differently, never change an output)."""

    def prepare_compact_linear(weight: torch.Tensor):
        if int4_kernel is not None and weight.is_floating_point():
            fast = int4_kernel(quant.quantize_int4(weight.float(), COMPACT_GROUP))
            if fast is not None:
                return fast
        return prepare_any(weight)

    return prepare_compact_linear


COMPACT_GROUP = 32  # prepare_compact_linear's int4 group size


def _prepare_cpu_linear(weight: torch.Tensor):
    """The CPU's form of a float weight: bfloat16 through the C tile kernel where it runs
    (AVX512-BF16 without AMX, or AVX2: kernels/cpu_linear.py), else (float32, an AMX CPU, or
    that kernel absent) oneDNN's packed layout; a bfloat16 weight the tile kernel does not take
    on a CPU where oneDNN has no bfloat16 path stays as it is, for F.linear."""
    fast = cpu_linear.prepare(weight)
    if fast is not None:
        return fast
    if weight.dtype not in _ONEDNN_NATIVE:
        return PlainLinear(weight)
    return onednn.prepare_linear(weight)


class PlainLinear:
    """A weight F.linear multiplies as it is (see _prepare_cpu_linear)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.nbytes = weight.numel() * weight.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, bias)


def _prepare_cpu_quantized(q: quant.QuantizedWeight):
    """The CPU's form of a quantized weight: int4 / per-channel int8 through the C kernels where
    the CPU has AVX512-BF16 or AVX2, else PyTorch's packed int8 / int4 ops, else the
    dequantizing reference."""
    return cpu_quant.prepare(q) or quant.prepare_packed(q)


_BACKENDS: dict[str, SimpleNamespace] = {"reference": _table("reference")}
# The dtypes whose oneDNN linear passed its self-check here.
_ONEDNN_NATIVE = tuple(dtype for dtype in onednn.DTYPES if onednn.available(dtype))
# The dtypes the CPU table (still named for oneDNN) serves; its other ops follow the input's
# dtype. bfloat16 joins where the C tile kernel runs it though oneDNN does not: on AVX2 CPUs
# without AVX-512 (Zen 2 / Zen 3 EPYCs) oneDNN refuses bfloat16, and bfloat16 weights through
# the tile kernels with a decode step in one C call beat float32 through oneDNN
# (benchmarks/cpu_avx2.py).
ONEDNN_DTYPES = _ONEDNN_NATIVE + (
    (torch.bfloat16,) if torch.bfloat16 not in _ONEDNN_NATIVE and _ONEDNN_NATIVE
    and cpu_linear.preferred() else ())
if ONEDNN_DTYPES:
    # The CPU table: oneDNN linears (bfloat16 ones through the C tile kernel where it runs), and
    # decode attention, RMSNorm, rotary and SwiGLU from the C kernels (built on first use; where
    # they do not build or pass their self-check, or do not take a call's dtype or shape, the
    # reference's ops run).
    _BACKENDS["onednn"] = _table("onednn", prepare_quantized=_prepare_cpu_quantized,
                                 int4_kernel=cpu_quant.prepare,
                                 prepare_linear=_prepare_cpu_linear, linear=onednn.linear,
                                 prepare_decode_stack=cpu_layers.prepare,
                                 prepare_draft_level=cpu_draft.prepare, **cpu_kernels.OPS)
# Importing triton takes a while and is only needed on CUDA: its table is built on first use.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_table() -> SimpleNamespace:
    from kernels import triton_ops

    return _table("triton", **{op: getattr(triton_ops, op) for op in triton_ops.OPS})


def _triton_imports() -> bool:
    """Whether the triton kernels load (an installed but broken triton counts as absent)."""
    if not _HAS_TRITON:
        return False
    try:
        _triton_table()
    except ImportError:
        return False
    return True


def available_backends() -> tuple[str, ...]:
    """Names of the kernel backends this installation has."""
    return (*_BACKENDS, "triton") if _HAS_TRITON else tuple(_BACKENDS)


def ops_for(device_type: str, dtype: torch.dtype, backend: str | None = None) -> SimpleNamespace:
    """The op table for a device and dtype: the forced backend if set, else the best available."""
    choice = backend or os.environ.get("SERVESCOPE_KERNELS", "auto")
    if choice == "auto":
        choice = _best(device_type, dtype)
    if choice not in available_backends():
        raise ValueError(
            f"Kernel backend '{choice}' is not available: choose one of "
            f"{', '.join(available_backends())} (SERVESCOPE_KERNELS)."
        )
    if choice == "onednn" and (device_type != "cpu" or dtype not in ONEDNN_DTYPES):
        names = " and ".join(str(d).removeprefix("torch.") for d in ONEDNN_DTYPES)
        raise ValueError(f"The onednn kernels run {names} on the CPU only here, not "
                         f"{str(dtype).removeprefix('torch.')} on {device_type}: use reference.")
    if choice == "triton":
        return _triton_for(device_type)
    return _BACKENDS[choice]


def _triton_for(device_type: str) -> SimpleNamespace:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device_type != "cuda" and not interpreted:
        raise ValueError(
            f"The triton kernels need a CUDA device, not '{device_type}': use the reference "
            "kernels there, or set TRITON_INTERPRET=1 before starting to run them (slowly) in "
            "Triton's interpreter."
        )
    return _triton_table()


def _best(device_type: str, dtype: torch.dtype) -> str:
    if device_type == "cuda" and _triton_imports():
        return "triton"
    if device_type == "cpu" and dtype in ONEDNN_DTYPES:
        return "onednn"
    return "reference"


def packs_linear_weights(device_type: str, dtype: torch.dtype, backend: str | None = None) -> bool:
    """Whether the table ops_for picks re-lays linear weights out into new matrices, so that a
    tied LM head is held twice, as the embedding and packed (engine/memory.py counts it)."""
    try:
        return ops_for(device_type, dtype, backend).name == "onednn"
    except ValueError:
        return False


__all__ = ["AttentionMass", "AttentionMetadata", "ONEDNN_DTYPES", "PrefillChunk",
           "available_backends", "ops_for", "packs_linear_weights", "OPS"]
