"""Decode through the CUDA-graph buckets' padded static tensors, checked on the CPU.

The capture itself needs a GPU (benchmarks/gpu.py runs it); what the CPU can check is everything
around it: padding a step up to its (batch, width) bucket, the null slot that padded rows use,
which steps the graphs serve, and the compiled step: torch.compile with the "aot_eager" backend
traces the whole forward pass into one graph (fullgraph: any break fails) with the cache ops as
custom ops and functionalizes their writes, as inductor would on CUDA, without generating code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM
from engine.block_manager import BlockManager
from engine.cuda_graphs import DecodeGraphs
from engine.model import LlamaModel
from engine.runner import ModelRunner, RunItem


@pytest.fixture(scope="module")
def model(demo_checkpoint):
    config = dataclasses.replace(demo_checkpoint.config, num_layers=4)
    return LlamaModel(config, demo_checkpoint.tensors, torch.device("cpu"), torch.float32, 512)


def _steps(vocab: int) -> list[list[RunItem]]:
    """Three prompts of different lengths, then three decode steps of all three."""
    gen = torch.Generator().manual_seed(3)
    lengths, tables = [5, 40, 17], [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    tokens = [torch.randint(vocab, (n + 3,), generator=gen).tolist() for n in lengths]
    steps = [[RunItem(t[:n], 0, b, 1) for t, n, b in zip(tokens, lengths, tables, strict=True)]]
    for k in range(3):
        steps.append([RunItem(t[n + k : n + k + 1], n + k, b, 1)
                      for t, n, b in zip(tokens, lengths, tables, strict=True)])
    return steps


def test_padded_decode_buckets_give_the_plain_logits(model):
    plain = ModelRunner(model, BlockManager(16, 16))
    graphed = ModelRunner(model, BlockManager(16, 16))
    graphed.use_decode_graphs(max_batch=8, max_width=512, capture=False)
    for items in _steps(model.config.vocab_size):
        want = plain.run_items(items).logits
        got = graphed.run_items(items).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert bool((graphed.kv[:, :, graphed.null_slot] == 0).all())
    # Three decodes padded to the batch-4 bucket, keys 41-43 wide padded to 256.
    assert list(graphed.decode_graphs._steps) == [(4, 256)]


def test_graphs_serve_only_plain_decode_steps(model):
    runner = ModelRunner(model, BlockManager(16, 16))
    graphs = DecodeGraphs(runner, max_batch=2, max_width=64, capture=False)
    prefill, decode = _steps(model.config.vocab_size)[:2]
    assert not graphs.handles(len(prefill), runner._metadata(prefill), all_logits=False)
    meta = runner._metadata(decode)
    assert not graphs.handles(len(decode), meta, all_logits=False)  # 3 rows, largest bucket 2
    assert graphs.handles(2, runner._metadata(decode[:2]), all_logits=False)
    assert not graphs.handles(2, runner._metadata(decode[:2]), all_logits=True)
    meta = runner._metadata(decode[:2])
    meta.want_mass = True
    assert not graphs.handles(2, meta, all_logits=False)
    assert graphs.batches == [1, 2]


def test_cuda_graphs_on_the_cpu_are_refused_before_loading():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not 'cpu'"):
        LLM("no-such-model.gguf", device="cpu", cuda_graphs=True)


def test_torch_compile_on_the_cpu_is_refused_before_loading():
    with pytest.raises(ValueError, match="Compiled decode steps need a CUDA device, not 'cpu'"):
        LLM("no-such-model.gguf", device="cpu", torch_compile=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_compiled_decode_steps_give_the_plain_logits_and_cache(model, kv_cache_dtype):
    plain = ModelRunner(model, BlockManager(16, 16), kv_cache_dtype)
    compiled = ModelRunner(model, BlockManager(16, 16), kv_cache_dtype)
    compiled.use_decode_graphs(max_batch=4, max_width=512, capture=False,
                               compile_backend="aot_eager")
    steps = _steps(model.config.vocab_size)
    steps.append(steps[-1][:1])  # a batch of one: another bucket (and graph: size 1 is special)
    for items in steps:
        want = plain.run_items(items).logits
        got = compiled.run_items(items).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The compiled store wrote the same K/V (and scales) into the real cache.
    lengths, tables = [5, 40, 17], [[0, 1, 2], [3, 4, 5, 6], [7, 8]]  # as _steps makes them
    slots = [table[t // 16] * 16 + t % 16 for n, table in zip(lengths, tables, strict=True)
             for t in range(n + 3)]
    as_bytes = (lambda t: t.view(torch.uint8)) if kv_cache_dtype == "int8" else (lambda t: t)
    torch.testing.assert_close(as_bytes(compiled.kv[:, :, slots]), as_bytes(plain.kv[:, :, slots]),
                               atol=1e-5, rtol=1e-5)
    assert sorted(compiled.decode_graphs._steps) == [(1, 256), (4, 256)]


def test_compiled_steps_refuse_prefills(model):
    from kernels.compiled import compilable

    runner = ModelRunner(model, BlockManager(16, 16))
    prefill = _steps(model.config.vocab_size)[0]
    meta = runner._metadata(prefill)
    ops = compilable(model.ops)
    q = torch.zeros(int(meta.slot_mapping.shape[0]), model.config.num_heads,
                    model.config.head_dim)
    with pytest.raises(ValueError, match="Compiled steps are decode-only"):
        ops.paged_attention(q, *runner.kv_caches[0], meta, 1.0)
