"""Attention, norm and rotary ops: torch references behind one dispatch point.

Every op the model runs is looked up here, so a faster implementation (Triton on CUDA) can
replace the reference for one device without the model knowing. `SERVESCOPE_KERNELS=reference`
forces the reference everywhere.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from kernels import reference
from kernels.metadata import AttentionMetadata, PrefillChunk

OPS = ("rms_norm", "rotary", "silu_and_mul", "store_kv", "paged_attention")

_BACKENDS: dict[str, SimpleNamespace] = {
    "reference": SimpleNamespace(**{name: getattr(reference, name) for name in OPS}),
}


def available_backends() -> tuple[str, ...]:
    """Names of the kernel backends this installation has."""
    return tuple(_BACKENDS)


def ops_for(device_type: str, backend: str | None = None) -> SimpleNamespace:
    """The op table for a device: the forced backend if set, else the best one available."""
    choice = backend or os.environ.get("SERVESCOPE_KERNELS", "auto")
    if choice == "auto":
        choice = "triton" if device_type == "cuda" and "triton" in _BACKENDS else "reference"
    if choice not in _BACKENDS:
        raise ValueError(
            f"Kernel backend '{choice}' is not available: choose one of "
            f"{', '.join(_BACKENDS)} (SERVESCOPE_KERNELS)."
        )
    return _BACKENDS[choice]


__all__ = ["AttentionMetadata", "PrefillChunk", "available_backends", "ops_for", "OPS"]
