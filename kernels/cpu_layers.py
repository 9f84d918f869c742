"""A step's decoder layers in one C call (cpu_kernels.c's decode_layers): bfloat16
activations, weights in the tile kernels' layouts (bfloat16: kernels/cpu_linear.py; int4 and
per-channel int8: kernels/cpu_quant.py); decode rows and bfloat16 prefill chunks (the prefill
attention kernel's), so a prompt's prefill and a step mixing prefills with decodes take one call
too (the model's loop cost a 110-token prefill of the demo model about 7 ms in calls).

Why: at decode sizes most of a layer's ops are tiny, and each cost 20-40 us of Python, ctypes and
dispatch in the model's loop (a demo-model step at batch 1 spent ~4 ms of ~22 in RMSNorm,
rotary, SwiGLU and the cache write, against a few us of arithmetic each). The C function runs
the same kernels in the same order, so the step's values are the same to the bit; the model
asks `DecodeStack.run` first and takes the long way wherever it answers None: eviction
statistics to gather, a cache that is quantized, prefill chunks where the prefill attention
kernel does not run, or a kernel that refused.
"""

from __future__ import annotations

import torch

from kernels import cpu_kernels, cpu_linear, cpu_quant
from kernels.cpu_kernels import int64_contiguous as _int64
from kernels.metadata import AttentionMetadata

# A linear's kind in the C table (cpu_kernels.c's LINEAR_*), then four values.
_BF16, _INT4, _INT8 = 0, 1, 2


class DecodeStack:
    """The model's layers as decode_layers takes them; build with `prepare`."""

    def __init__(self, layers: list, dims: dict, linears: list[list[tuple]],
                 biases: list) -> None:
        self.dims = dims
        self.amx = cpu_linear.amx_runs()
        self._biases = biases  # kept: the table points at them
        self._weights = [(la.input_norm.data_ptr(), la.post_norm.data_ptr(), four)
                         for la, four in zip(layers, linears, strict=True)]
        # The quantized weights' matmul_rows, for cpu_quant.int4_path and on_amx (0: none of
        # that kind, or an int8 one whose inputs are not whole A tiles).
        weights = [w for la in layers for w in (la.qkv, la.o, la.gate_up, la.down)]
        self._int4_matmul_rows, self._int8_matmul_rows = (
            min((w.matmul_rows for w in weights if isinstance(w, kind)), default=0)
            for kind in (cpu_quant.Int4Linear, cpu_quant.Int8Linear))
        self._table: torch.Tensor | None = None
        self._caches_key: tuple | None = None

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list, streams: dict | None = None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream) for a step of decode rows and prefill
        chunks, or None where this step must take the model's own loop. `streams` (layer count
        -> None) is filled as LlamaModel.forward's."""
        n = h.shape[0]
        decode_rows = 0 if meta.decode_token_index is None else meta.decode_token_index.shape[0]
        if (meta.want_mass or decode_rows + sum(c.end - c.start for c in meta.prefills) != n
                or (decode_rows and meta.decode_slots is None)
                or (meta.prefills and not self._takes_prefills(meta))):
            return None
        table = self._pointer_table(kv_caches)
        if table is None:
            return None
        if decode_rows:
            slots, lengths = _int64(meta.decode_slots), cpu_kernels._lengths(meta)
            index = _int64(meta.decode_token_index)
        else:
            slots = lengths = index = torch.zeros(1, dtype=torch.int64)
        # Each chunk's keys and mask as prefill_attention takes them (kept alive by `held`).
        held = [(_int64(c.slots), cpu_kernels.prefill_mask(c)) for c in meta.prefills]
        chunks = torch.tensor([[c.start, c.end - c.start, keys.shape[0], keys.data_ptr(),
                                0 if mask is None else mask.data_ptr()]
                               for c, (keys, mask) in zip(meta.prefills, held, strict=True)]
                              or [[0] * 5], dtype=torch.int64)
        slot_mapping = _int64(meta.slot_mapping)
        # A copy: the kernel writes each layer's output over it, and where it refuses, the
        # loop must start again from the embeddings.
        h = h.clone(memory_format=torch.contiguous_format)
        cos, sin = cos.contiguous(), sin.contiguous()
        residual = torch.empty_like(h)
        d = self.dims
        int4_path = cpu_quant.int4_path(n, self._int4_matmul_rows, bf16=True)
        int8_amx = cpu_quant.on_amx(n, self._int8_matmul_rows, bf16=True)
        kept = {layers: torch.empty_like(h) for layers in streams or ()}
        aux = (torch.tensor([kept[l + 1].data_ptr() if l + 1 in kept else 0
                             for l in range(len(self._weights))], dtype=torch.int64)
               if kept else None)
        status = cpu_kernels._library().decode_layers(
            table.data_ptr(), len(self._weights), h.data_ptr(), residual.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), slots.data_ptr(),
            lengths.data_ptr(), n, d["hidden"], d["heads"], d["kv_heads"], d["head_dim"],
            d["intermediate"], slots.shape[-1], decode_rows, index.data_ptr(),
            len(meta.prefills), chunks.data_ptr(), 0 if aux is None else aux.data_ptr(),
            d["eps"], d["scale"], int(self.amx), int4_path, int(int8_amx),
            torch.get_num_threads())
        if status != 0:
            return None
        if streams is not None:
            streams.update(kept)
        return h, residual

    def _takes_prefills(self, meta: AttentionMetadata) -> bool:
        """Whether the prefill kernel runs here and takes every chunk of the step (else the
        call would fail at the first layer's attention and the loop run the step again)."""
        d = self.dims
        return (cpu_kernels.prefill_takes(d["head_dim"]) and cpu_kernels.prefill_available()
                and all(cpu_kernels.prefill_chunk_fits(c, d["kv_heads"], d["head_dim"])
                        for c in meta.prefills))

    def _pointer_table(self, kv_caches: list) -> torch.Tensor | None:
        """The int64 table of every layer's weights and caches; rebuilt when the caches move,
        None where a cache is not a plain bfloat16 tensor the kernels read."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair
                    if isinstance(t, torch.Tensor))
        if key != self._caches_key:
            self._table = None
            if all(_plain_cache(k) and _plain_cache(v) for k, v in kv_caches) \
                    and len(kv_caches) == len(self._weights):
                rows = [(norm, post, k.data_ptr(), v.data_ptr(), *(f for lin in four for f in lin))
                        for (norm, post, four), (k, v) in zip(self._weights, kv_caches,
                                                              strict=True)]
                self._table = torch.tensor(rows, dtype=torch.int64).reshape(-1)
            self._caches_key = key
        return self._table


def _plain_cache(cache) -> bool:
    return (isinstance(cache, torch.Tensor) and cache.dtype == torch.bfloat16
            and cache.device.type == "cpu" and cache.is_contiguous())


def _linear_fields(weight, bias: torch.Tensor | None) -> tuple | None:
    """A linear's five table values, or None where the C function does not take it: a float
    weight outside the tile layout, inputs padded for the tiles (the activations are not), or a
    bias on a quantized weight (its linear adds it in torch)."""
    if getattr(weight, "padded_in", None) != getattr(weight, "in_features", 0):
        return None
    if isinstance(weight, cpu_linear.Bf16Linear):
        return (_BF16, weight.tiles.data_ptr(), 0 if bias is None else bias.data_ptr(), 0, 0)
    if bias is not None:
        return None
    if isinstance(weight, cpu_quant.Int4Linear):
        return (_INT4, weight.codes.data_ptr(), weight.scales.data_ptr(),
                weight.mins.data_ptr(), weight.group_size)
    if isinstance(weight, cpu_quant.Int8Linear):
        return (_INT8, weight.codes.data_ptr(), weight.scales.data_ptr(), 0, 0)
    return None


def prepare(layers: list, dims: dict) -> DecodeStack | None:
    """The layers as one decode call, or None where it does not apply: activations other than
    bfloat16, a linear the C function does not take (_linear_fields), head or model sizes the
    kernels do not take, or kernels that do not run here."""
    dim = dims["head_dim"]
    if (not layers or any(la.input_norm.dtype != torch.bfloat16 for la in layers)
            or dim % 32 or dim > cpu_kernels.MAX_DIM or dims["hidden"] % 16
            or dims["intermediate"] % 16 or not cpu_kernels.available()):
        return None
    biases = [None if la.qkv_bias is None else la.qkv_bias.to(torch.bfloat16).contiguous()
              for la in layers]
    linears = [[_linear_fields(la.qkv, bias), _linear_fields(la.o, None),
                _linear_fields(la.gate_up, None), _linear_fields(la.down, None)]
               for la, bias in zip(layers, biases, strict=True)]
    if any(f is None for four in linears for f in four):
        return None
    return DecodeStack(layers, dims, linears, biases)
