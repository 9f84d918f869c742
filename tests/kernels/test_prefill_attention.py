"""The CPU's prefill attention kernel (cpu_kernels.c's prefill_attention): a chunk of bfloat16
queries over its keys in the paged cache, against the float32 torch reference on the same
bfloat16 inputs; a query's output the same alone or in any chunk; a draft tree's mask obeyed;
and the demo model's real prompt logits through it against the torch path."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.runner import RunItem
from kernels import cpu_kernels, cpu_layers, reference
from kernels.metadata import AttentionMetadata, PrefillChunk

pytestmark = pytest.mark.skipif(not cpu_kernels.prefill_available(),
                                reason="the prefill attention kernel needs AVX512-BF16")


def _inputs(n: int, ctx: int, kv_heads: int, group: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    slots_total = ctx + 37
    k = torch.randn(slots_total, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(slots_total, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(n, kv_heads * group, dim, generator=gen).to(torch.bfloat16)
    # The keys scattered over the cache, as a block table scatters them.
    slots = torch.randperm(slots_total, generator=gen)[:ctx]
    return q, k, v, slots


def _causal(n: int, ctx: int) -> torch.Tensor:
    return torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)


def _float_reference(q, k, v, chunk, scale):
    return reference._prefill_attention(q.float(), k.float(), v.float(), chunk, scale)


@pytest.mark.parametrize("n, ctx, kv_heads, group, dim", [
    (1, 1, 1, 1, 64),          # one query, one key
    (7, 7, 3, 3, 64),          # fewer queries than a tile
    (110, 110, 3, 3, 64),      # the demo model's heads, a chat prompt
    (17, 300, 3, 3, 64),       # a chunk after a cached prefix: causal from position 283
    (300, 300, 3, 3, 64),      # past one block of 256 keys (the online softmax's rescaling)
    (600, 1000, 3, 3, 64),     # many blocks, an offset
    (33, 33, 8, 8, 128),       # Llama-70B's grouping, head dim 128
    (20, 20, 2, 1, 32),        # no grouping, the smallest head dim taken
])
def test_causal_chunks_match_the_float_reference(n, ctx, kv_heads, group, dim):
    q, k, v, slots = _inputs(n, ctx, kv_heads, group, dim)
    chunk = PrefillChunk(0, n, slots, None if n == ctx else _causal(n, ctx), causal=True)
    got = cpu_kernels.prefill_attention(q, k, v, chunk, dim ** -0.5)
    want = _float_reference(q, k, v, chunk, dim ** -0.5)
    torch_bf16 = reference._prefill_attention(q, k, v, chunk, dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    error = (got.float() - want).abs()
    # Within bfloat16's rounding of the output (outputs are O(1)), and on average no further
    # from the exact result than torch's own bfloat16 attention.
    assert error.max() <= 1.6e-2
    assert error.mean() <= 1.5 * (torch_bf16.float() - want).abs().mean() + 1e-4


def test_a_query_gets_the_same_output_alone_or_in_any_chunk():
    """Key blocks start at key 0 whatever the chunk, so chunked prefill, a prefix-cache hit and
    a whole prefill give each query the same bits."""
    n, kv_heads, group, dim = 300, 3, 3, 64
    q, k, v, slots = _inputs(n, n, kv_heads, group, dim, seed=1)
    whole = cpu_kernels.prefill_attention(q, k, v, PrefillChunk(0, n, slots, None, causal=True),
                                          0.125)
    for start, end in ((0, 16), (250, 300), (100, 101), (17, 290)):
        part = cpu_kernels.prefill_attention(
            q[start:end], k, v, PrefillChunk(0, end - start, slots[:end],
                                              _causal(end - start, end), causal=True), 0.125)
        assert torch.equal(part, whole[start:end])


def test_a_draft_trees_mask_is_obeyed():
    """A chunk ending in a draft tree (causal=False): each draft sees its ancestors only, not
    its siblings, so the kernel must read the mask rather than assume causality."""
    n, ctx, kv_heads, group, dim = 24, 400, 3, 3, 64
    q, k, v, slots = _inputs(n, ctx, kv_heads, group, dim, seed=2)
    mask = _causal(n, ctx)
    # The last four queries are a tree: 0 under the root, 1 and 2 under 0, 3 under 1.
    mask[n - 4 :, ctx - 4 :] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0],
                                             [1, 1, 0, 1]], dtype=torch.bool)
    # Node 1's key points along node 2's queries: were siblings visible, it would take most
    # of node 2's attention.
    k[slots[ctx - 3]] = 3 * q[n - 2].view(kv_heads, group, dim)[:, 0]
    tree = PrefillChunk(0, n, slots, mask, causal=False)
    got = cpu_kernels.prefill_attention(q, k, v, tree, 0.125)
    want = _float_reference(q, k, v, tree, 0.125)
    assert (got.float() - want).abs().max() <= 1.6e-2
    # Read as causal, sibling 2 would see sibling 1: a different result.
    as_causal = _float_reference(q, k, v, PrefillChunk(0, n, slots, _causal(n, ctx)), 0.125)
    assert (got[n - 2].float() - as_causal[n - 2]).abs().max() > 0.5


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 64), (torch.bfloat16, 48),
                                        (torch.bfloat16, 288)])
def test_what_the_kernel_does_not_take_runs_the_torch_path(dtype, dim):
    q, k, v, slots = _inputs(9, 9, 1, 3, dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, 9, slots, None,
                                                                        causal=True)])
    got = cpu_kernels.paged_attention(q, k, v, meta, dim ** -0.5)
    assert torch.equal(got, reference.paged_attention(q, k, v, meta, dim ** -0.5))


def test_the_demo_models_prompt_logits_agree_with_the_torch_path(demo_gguf, monkeypatch):
    """A real prompt through the demo model in bfloat16, every position's logits, with the
    kernel and with torch's attention: the same next token nearly everywhere and a tiny
    divergence between the distributions (both round to bfloat16, in different places)."""
    llm = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=1024)
    prompt = llm.chat_prompt([{"role": "user", "content": "Explain in three sentences why the "
                               "sky is blue, and why sunsets are red."}])

    def logits() -> torch.Tensor:
        item = RunItem(tokens=prompt, start=0, block_table=list(range(64)),
                       logit_rows=len(prompt))
        return llm.runner.run_items([item], all_logits=True).logits.float()

    # The kernel runs inside the step's one C call (cpu_layers) or, where the model has none,
    # from the layer loop: one way or the other, every layer's chunk goes through it.
    kernel_calls, fused = [], []
    real_kernel, real_run = cpu_kernels._prefill_kernel, cpu_layers.DecodeStack.run
    monkeypatch.setattr(cpu_kernels, "_prefill_kernel",
                        lambda *a: kernel_calls.append(1) or real_kernel(*a))
    monkeypatch.setattr(cpu_layers.DecodeStack, "run",
                        lambda *a: fused.append(real_run(*a)) or fused[-1])
    with_kernel = logits()
    assert (fused and fused[0] is not None) or len(kernel_calls) == llm.model.config.num_layers
    monkeypatch.setattr(cpu_kernels, "prefill_available", lambda: False)
    with_torch = logits()
    llm.close()
    assert with_kernel.shape == with_torch.shape and with_kernel.shape[0] == len(prompt)
    same_top = (with_kernel.argmax(-1) == with_torch.argmax(-1)).float().mean()
    kl = torch.nn.functional.kl_div(with_kernel.log_softmax(-1), with_torch.log_softmax(-1),
                                    log_target=True, reduction="batchmean")
    assert same_top >= 0.95
    assert kl <= 0.01


def test_a_mask_it_cannot_read_as_one_byte_per_key_runs_the_torch_path():
    """A mask the kernel would misread (broadcast over the queries, or additive floats) is left
    to torch, which reads it as SDPA does."""
    n, ctx = 6, 20
    q, k, v, slots = _inputs(n, ctx, 1, 3, 64, seed=3)
    broadcast = torch.ones(1, ctx, dtype=torch.bool)
    broadcast[0, 5] = False
    additive = torch.zeros(n, ctx)
    additive[:, 7] = float("-inf")
    for mask in (broadcast, additive):
        chunk = PrefillChunk(0, n, slots, mask, causal=False)
        assert cpu_kernels._prefill_kernel(q, k, v, chunk, 0.125) is None
        got = cpu_kernels.prefill_attention(q, k, v, chunk, 0.125)
        assert torch.equal(got, reference._prefill_attention(q, k, v, chunk, 0.125))
