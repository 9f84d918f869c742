"""The cache-touching ops as torch custom ops, so torch.compile traces a whole decode step.

torch.compile cannot see through the KV cache's ops as they are: the Triton wrappers launch
kernels through Python that Dynamo would have to trace, and a store into the cache is a
mutation of memory the compiled graph does not own. Registered as custom ops (with the tensors
they write declared and a fake implementation giving output shapes), both become single opaque
nodes: the compiler fuses and schedules everything around them (norms, rotary, SwiGLU, the
matmuls' glue) and calls them as they are. Each op runs the table's own implementation
(`backend`: the Triton kernels on CUDA, the torch reference elsewhere), so the compiled step
computes what the eager one does.

Only decode-only steps are compiled (engine/cuda_graphs.py pads them to fixed buckets): a
prefill's per-chunk layout would recompile for every new chunk length.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels import cpu_kernels, reference
from kernels.kv_quant import QuantizedCache
from kernels.metadata import AttentionMetadata


def _module(backend: str):
    """The implementation a table named `backend` uses for the cache ops."""
    if backend == "triton":
        from kernels import triton_ops

        return triton_ops
    return reference  # the reference and oneDNN tables share the reference's attention


def _cache(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | QuantizedCache:
    return values if scale is None else QuantizedCache(values, scale)


def _split(cache: torch.Tensor | QuantizedCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(cache, QuantizedCache):
        return cache.data, cache.scale
    return cache, None


@torch.library.custom_op("servescope::store_kv",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
              slot_mapping: torch.Tensor, backend: str) -> None:
    _module(backend).store_kv(k, v, _cache(k_cache, k_scale), _cache(v_cache, v_scale),
                              slot_mapping)


@_store_kv.register_fake
def _store_kv_fake(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, backend) -> None:
    return None


@torch.library.custom_op("servescope::decode_attention", mutates_args=())
def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                      token_index: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, backend: str) -> torch.Tensor:
    meta = AttentionMetadata(slot_mapping=token_index, decode_token_index=token_index,
                             decode_slots=slots, decode_mask=mask)
    return _module(backend).paged_attention(q, _cache(k_cache, k_scale),
                                            _cache(v_cache, v_scale), meta, scale)


@_decode_attention.register_fake
def _decode_attention_fake(q, k_cache, v_cache, k_scale, v_scale, token_index, slots, mask,
                           scale, backend) -> torch.Tensor:
    return torch.empty_like(q)


def compilable(table: SimpleNamespace) -> SimpleNamespace:
    """`table` with store_kv and paged_attention going through the custom ops; its other ops
    stay as they are (compiled with the step), but for the C kernels' (the reference's)."""

    def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
        (kc, ks), (vc, vs) = _split(k_cache), _split(v_cache)
        torch.ops.servescope.store_kv(k, v, kc, vc, ks, vs, slot_mapping, table.name)

    def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if meta.prefills or meta.want_mass or meta.decode_slots is None:
            raise ValueError("Compiled steps are decode-only without attention statistics: run "
                             "prefills and KV-eviction steps eagerly.")
        (kc, ks), (vc, vs) = _split(k_cache), _split(v_cache)
        return torch.ops.servescope.decode_attention(
            q, kc, vc, ks, vs, meta.decode_token_index, meta.decode_slots, meta.decode_mask,
            scale, table.name)

    # The CPU's C kernels are ctypes calls Dynamo cannot trace: the compiled step takes the
    # reference's versions of those ops, which the compiler fuses anyway.
    traceable = {op: getattr(reference, op) for op, fn in cpu_kernels.OPS.items()
                 if getattr(table, op) is fn}
    return SimpleNamespace(**(vars(table) | traceable | {"name": f"{table.name}+compile",
                                                         "store_kv": store_kv,
                                                         "paged_attention": paged_attention}))
