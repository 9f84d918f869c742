"""Attention, norm and rotary ops: torch references behind one dispatch point.

Every op the model runs is looked up here, so a faster implementation (oneDNN linear layers on
the CPU, Triton on CUDA) can replace the reference for one device without the model knowing.
`SERVESCOPE_KERNELS=reference` forces the reference everywhere.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from kernels import onednn, reference
from kernels.metadata import AttentionMass, AttentionMetadata, PrefillChunk

OPS = ("prepare_linear", "linear", "rms_norm", "rotary", "silu_and_mul", "store_kv",
       "paged_attention", "paged_attention_mass")


def _table(name: str, **overrides) -> SimpleNamespace:
    ops = {op: getattr(reference, op) for op in OPS} | overrides
    return SimpleNamespace(name=name, **ops)


_BACKENDS: dict[str, SimpleNamespace] = {"reference": _table("reference")}
if onednn.available():
    _BACKENDS["onednn"] = _table("onednn", prepare_linear=onednn.prepare_linear,
                                 linear=onednn.linear)


def available_backends() -> tuple[str, ...]:
    """Names of the kernel backends this installation has."""
    return tuple(_BACKENDS)


def ops_for(device_type: str, dtype: torch.dtype, backend: str | None = None) -> SimpleNamespace:
    """The op table for a device and dtype: the forced backend if set, else the best available."""
    choice = backend or os.environ.get("SERVESCOPE_KERNELS", "auto")
    if choice == "auto":
        choice = _best(device_type, dtype)
    if choice not in _BACKENDS:
        raise ValueError(
            f"Kernel backend '{choice}' is not available: choose one of "
            f"{', '.join(_BACKENDS)} (SERVESCOPE_KERNELS)."
        )
    if choice == "onednn" and (device_type != "cpu" or dtype != torch.float32):
        raise ValueError("The onednn kernels run float32 on the CPU only: use reference.")
    return _BACKENDS[choice]


def _best(device_type: str, dtype: torch.dtype) -> str:
    if device_type == "cuda" and "triton" in _BACKENDS:
        return "triton"
    if device_type == "cpu" and dtype == torch.float32 and "onednn" in _BACKENDS:
        return "onednn"
    return "reference"


__all__ = ["AttentionMass", "AttentionMetadata", "PrefillChunk", "available_backends", "ops_for", "OPS"]
