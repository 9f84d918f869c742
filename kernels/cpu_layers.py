"""A decode step's decoder layers in one C call (cpu_kernels.c's decode_layers), bfloat16 weights
in the tile layout (kernels/cpu_linear.py).

Why: at decode sizes most of a layer's ops are tiny, and each cost 20-40 us of Python, ctypes and
dispatch in the model's loop (a demo-model step at batch 1 spent ~4 ms of ~22 in RMSNorm,
rotary, SwiGLU and the cache write, against a few us of arithmetic each). The C function runs
the same kernels in the same order, so the step's values are the same to the bit; the model
asks `DecodeStack.run` first and takes the long way wherever it answers None: a step with
prefill rows or draft trees, eviction statistics to gather, a cache that is quantized, or a
kernel that refused.
"""

from __future__ import annotations

import torch

from kernels import cpu_kernels, cpu_linear
from kernels.metadata import AttentionMetadata

_FIELDS = 9  # pointers per layer in the C table


class DecodeStack:
    """The model's layers as decode_layers takes them; build with `prepare`."""

    def __init__(self, layers: list, dims: dict, amx: bool) -> None:
        self.dims = dims
        self.amx = amx
        # Kept so the pointers stay valid (a bias is converted once here).
        self._biases = [None if la.qkv_bias is None else
                        la.qkv_bias.to(torch.bfloat16).contiguous() for la in layers]
        self._weights = [
            (la.input_norm.data_ptr(), la.qkv.tiles.data_ptr(),
             0 if b is None else b.data_ptr(), la.o.tiles.data_ptr(), la.post_norm.data_ptr(),
             la.gate_up.tiles.data_ptr(), la.down.tiles.data_ptr())
            for la, b in zip(layers, self._biases, strict=True)]
        self._table: torch.Tensor | None = None
        self._caches_key: tuple | None = None

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream) for a decode-only step, or None where
        this step must take the model's own loop."""
        n = h.shape[0]
        if (meta.want_mass or meta.prefills or meta.decode_token_index is None
                or meta.decode_token_index.shape[0] != n or meta.decode_slots is None):
            return None
        table = self._pointer_table(kv_caches)
        if table is None:
            return None
        slots = meta.decode_slots
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        lengths = cpu_kernels._lengths(meta)
        slot_mapping = meta.slot_mapping
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.to(torch.int64).contiguous()
        # A copy: the kernel writes each layer's output over it, and where it refuses, the
        # loop must start again from the embeddings.
        h = h.clone(memory_format=torch.contiguous_format)
        cos, sin = cos.contiguous(), sin.contiguous()
        residual = torch.empty_like(h)
        d = self.dims
        status = cpu_kernels._library().decode_layers(
            table.data_ptr(), len(self._weights), h.data_ptr(), residual.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), slots.data_ptr(),
            lengths.data_ptr(), n, d["hidden"], d["heads"], d["kv_heads"], d["head_dim"],
            d["intermediate"], slots.shape[1], d["eps"], d["scale"], int(self.amx),
            torch.get_num_threads())
        return (h, residual) if status == 0 else None

    def _pointer_table(self, kv_caches: list) -> torch.Tensor | None:
        """The int64 table of every layer's weights and caches; rebuilt when the caches move,
        None where a cache is not a plain bfloat16 tensor the kernels read."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair
                    if isinstance(t, torch.Tensor))
        if key != self._caches_key:
            self._table = None
            if all(_plain_cache(k) and _plain_cache(v) for k, v in kv_caches) \
                    and len(kv_caches) == len(self._weights):
                rows = [(*w, k.data_ptr(), v.data_ptr())
                        for w, (k, v) in zip(self._weights, kv_caches, strict=True)]
                self._table = torch.tensor(rows, dtype=torch.int64).reshape(-1)
            self._caches_key = key
        return self._table


def _plain_cache(cache) -> bool:
    return (isinstance(cache, torch.Tensor) and cache.dtype == torch.bfloat16
            and cache.device.type == "cpu" and cache.is_contiguous())


def prepare(layers: list, dims: dict) -> DecodeStack | None:
    """The layers as one decode call, or None where it does not apply: weights other than
    bfloat16 in the tile layout (float32, oneDNN's, quantized), inputs padded for the tiles,
    the four linears not all on one kernel (AMX or the AVX512-BF16 loop), head or model sizes
    the kernels do not take, or kernels that do not run here."""
    linears = [w for la in layers for w in (la.qkv, la.o, la.gate_up, la.down)]
    if not linears or not all(isinstance(w, cpu_linear.Bf16Linear)
                              and w.padded_in == w.in_features for w in linears):
        return None
    kinds = {w.tiles.shape[1] % (cpu_linear.AMX_INPUTS // 2) == 0 and cpu_linear.amx_runs()
             for w in linears}
    if len(kinds) != 1:
        return None
    dim = dims["head_dim"]
    if (dim % 32 or dim > cpu_kernels.MAX_DIM or dims["hidden"] % 16 or dims["intermediate"] % 16
            or any(la.input_norm.dtype != torch.bfloat16 for la in layers)
            or not cpu_kernels.available()):
        return None
    return DecodeStack(layers, dims, kinds.pop())
