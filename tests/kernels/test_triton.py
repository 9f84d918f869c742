"""Every Triton kernel against its torch reference, run on the CPU by Triton's interpreter.

Triton decides between compiling and interpreting when a kernel is decorated, and reads
TRITON_INTERPRET again while an interpreted kernel runs (and when triton itself is first imported),
so this module imports triton and the kernels with the variable set, and sets it again around each
of its own tests only: the other tests see the environment they started with.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys

import pytest
import torch

import kernels
from engine.block_manager import BlockManager
from engine.model import LlamaModel
from engine.runner import ModelRunner, RunItem, _chunk_mask, _slot_table
from kernels import AttentionMetadata, PrefillChunk, kv_quant, reference


def _import_interpreted():
    """kernels.triton_ops with its kernels (and triton's own jit functions) interpreted."""
    earlier = "triton" in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton_language = pytest.importorskip(
            "triton.language", reason="triton is not installed (the dev extra has it on Linux "
                                      "x86_64)")
        if earlier and type(triton_language.sum).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before this module without TRITON_INTERPRET=1, so "
                        "its kernels cannot be interpreted: run this file on its own",
                        allow_module_level=True)
        sys.modules.pop("kernels.triton_ops", None)
        return importlib.import_module("kernels.triton_ops")
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


tops = _import_interpreted()


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tolerance(dtype: torch.dtype) -> dict:
    # bfloat16: one unit in the last place, since the interpreter rounds float32 to bfloat16
    # differently from torch (its numpy has no bfloat16).
    return {torch.float32: {"atol": 1e-5, "rtol": 1e-4},
            torch.float16: {"atol": 3e-3, "rtol": 3e-3},
            torch.bfloat16: {"atol": 4e-2, "rtol": 1.6e-2}}[dtype]


# The elementwise kernels also run in bfloat16 (the engine's default on CUDA); attention cannot
# be checked so here: the interpreter's tl.dot returns garbage for bfloat16 inputs (numpy has no
# bfloat16), so the attention kernels' bfloat16 build is checked by compiling it
# (test_triton_compile.py) and on a GPU by benchmarks/gpu.py.
ELEMENTWISE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- elementwise and norm ops ----
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (3, 100)])
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    res = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    got, got_res = tops.rms_norm(x, w, 1e-5, res)
    want, want_res = reference.rms_norm(x, w, 1e-5, res)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    exact = {"atol": 0, "rtol": 0} if dtype != torch.bfloat16 else _tolerance(dtype)
    torch.testing.assert_close(got_res, want_res, **exact)


@pytest.mark.parametrize("n,heads,kv_heads,dim", [(1, 9, 3, 64), (5, 4, 4, 32), (3, 8, 1, 16)])
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_rotary_matches_reference_on_split_qkv(n, heads, kv_heads, dim, dtype):
    gen = torch.Generator().manual_seed(n * heads + dim)
    # q and k as the model has them: strided views into one fused QKV projection.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(n, heads, dim), k.view(n, kv_heads, dim)
    angles = torch.rand(n, dim // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got_q, got_k = tops.rotary(q, k, cos, sin)
    want_q, want_k = reference.rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **_tolerance(dtype))
    torch.testing.assert_close(got_k, want_k, **_tolerance(dtype))


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 100), (2, 3, 2 * 64)])
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_silu_and_mul_matches_reference(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])).to(dtype) * 4
    torch.testing.assert_close(tops.silu_and_mul(x), reference.silu_and_mul(x),
                               **_tolerance(dtype))


@pytest.mark.parametrize("n,kv_heads,dim", [(1, 3, 64), (6, 1, 16), (11, 2, 24)])
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_store_kv_matches_reference(n, kv_heads, dim, dtype):
    gen = torch.Generator().manual_seed(n + dim)
    slots = 64
    kv = torch.randn(n, 2 * kv_heads * dim, generator=gen).to(dtype)
    k, v = (t.view(n, kv_heads, dim) for t in kv.split(kv_heads * dim, dim=-1))  # strided
    slot_mapping = torch.randperm(slots, generator=gen)[:n]
    caches = [torch.randn(slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    got = [c.clone() for c in caches]
    tops.store_kv(k, v, got[0], got[1], slot_mapping)
    reference.store_kv(k, v, caches[0], caches[1], slot_mapping)
    torch.testing.assert_close(got, caches, atol=0, rtol=0)


# ---- paged attention ----
def _paged_batch(gen, seqs, heads, kv_heads, dim, block_size, dtype):
    """A step like the runner's: (context so far, new tokens) per sequence, blocks scattered
    through a cache full of other requests' values, metadata from the runner's own helpers."""
    total = [ctx + n for ctx, n in seqs]
    num_blocks = sum(-(-t // block_size) for t in total) + 3
    null_slot = num_blocks * block_size
    k_cache = torch.randn(null_slot + 1, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(null_slot + 1, kv_heads, dim, generator=gen).to(dtype)
    k_cache[null_slot] = v_cache[null_slot] = 0
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in total]
    slots = torch.from_numpy(_slot_table(tables, total, block_size, null_slot))
    q = torch.randn(sum(n for _, n in seqs), heads, dim, generator=gen).to(dtype)
    decode_rows, decode_idx, prefills, row = [], [], [], 0
    for i, (_, n) in enumerate(seqs):
        if n == 1:
            decode_rows.append(i)
            decode_idx.append(row)
        else:
            prefills.append(PrefillChunk(row, row + n, slots[i, : total[i]],
                                         _chunk_mask(n, total[i], torch.device("cpu"))))
        row += n
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), prefills=prefills)
    if decode_rows:
        lengths = torch.tensor([total[i] for i in decode_rows])
        longest = int(lengths.max())
        meta.decode_token_index = torch.tensor(decode_idx)
        meta.decode_slots = slots[decode_rows, :longest]
        if int(lengths.min()) != longest:
            meta.decode_mask = (torch.arange(longest) < lengths[:, None])[:, None, None, :]
    return q, k_cache, v_cache, meta


ATTENTION_CASES = [
    # heads, kv_heads (GQA ratio 1 / 3 / 8), head dim, block size, dtype
    (2, 2, 16, 16, torch.float32),
    (6, 2, 64, 32, torch.float32),
    (8, 1, 24, 16, torch.float32),
    (9, 3, 64, 16, torch.float16),
]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,dtype", ATTENTION_CASES)
def test_paged_attention_matches_reference(heads, kv_heads, dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 100 + dim + block_size)
    # Padded decodes of odd lengths (one past a 64-key block), a fresh prefill, a later chunk
    # over a partly filled block, and a chunk longer than one query tile.
    seqs = [(0, 1), (16, 1), (70, 1), (32, 1), (0, 13), (37, 29), (5, 70)]
    q, k_cache, v_cache, meta = _paged_batch(gen, seqs, heads, kv_heads, dim, block_size, dtype)
    scale = 1 / math.sqrt(dim)
    got = tops.paged_attention(q, k_cache, v_cache, meta, scale)
    want = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, want, **_tolerance(dtype))


@pytest.mark.parametrize("seqs", [[(7, 1)], [(40, 1), (9, 1)], [(20, 1), (20, 1)]])
def test_decode_only_batches_with_and_without_padding(seqs):
    gen = torch.Generator().manual_seed(len(seqs) + seqs[0][0])
    q, k_cache, v_cache, meta = _paged_batch(gen, seqs, 6, 2, 32, 16, torch.float32)
    assert (meta.decode_mask is None) == (len({c for c, _ in seqs}) == 1)
    got = tops.paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, reference.paged_attention(q, k_cache, v_cache, meta, 0.2),
                               **_tolerance(torch.float32))


@pytest.mark.parametrize("heads,kv_heads,splits", [(6, 2, None), (9, 3, 3), (8, 1, 5)])
def test_split_decode_matches_reference(heads, kv_heads, splits):
    """Long contexts split across programs (flash-decoding), one short padded row whose later
    splits hold no key at all, recombined by the combine kernel."""
    gen = torch.Generator().manual_seed(heads + kv_heads)
    seqs = [(600, 1), (20, 1), (333, 1)]
    q, k_cache, v_cache, meta = _paged_batch(gen, seqs, heads, kv_heads, 32, 32, torch.float32)
    if splits is None:
        assert tops._decode_splits(len(seqs), kv_heads, 601, q.device) > 1
    out = torch.zeros_like(q)
    tops.decode_attention(q, k_cache, v_cache, meta, 0.2, out, splits=splits)
    want = reference.paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, want, **_tolerance(torch.float32))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_decode_attention_mass_is_the_summed_softmax(heads, kv_heads):
    gen = torch.Generator().manual_seed(heads)
    seqs = [(3, 1), (80, 1), (41, 1)]
    dim, scale = 32, 0.3
    q, k_cache, v_cache, meta = _paged_batch(gen, seqs, heads, kv_heads, dim, 16, torch.float32)
    out = torch.empty_like(q)
    mass = tops.decode_attention(q, k_cache, v_cache, meta, scale, out, return_mass=True)
    # Explicit softmax per decode query and query head, summed over each KV head's query heads.
    keys = k_cache[meta.decode_slots]  # [B, T, Hkv, D]
    qd = q[meta.decode_token_index].view(len(seqs), kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qd, keys) * scale
    valid = meta.decode_mask.view(len(seqs), 1, 1, -1)
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    assert mass.shape == (len(seqs), kv_heads, meta.decode_slots.shape[1])
    torch.testing.assert_close(mass, probs.sum(2), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mass.sum(-1), torch.full_like(mass[..., 0], heads // kv_heads))
    assert bool((mass[~valid.view(len(seqs), 1, -1).expand_as(mass)] == 0).all())
    torch.testing.assert_close(out[meta.decode_token_index],
                               reference.paged_attention(q, k_cache, v_cache, meta, scale)
                               [meta.decode_token_index], **_tolerance(torch.float32))


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,dtype", ATTENTION_CASES)
def test_paged_attention_mass_matches_reference(heads, kv_heads, dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 7 + dim)
    seqs = [(0, 1), (70, 1), (0, 13), (37, 29), (5, 70)]
    q, k_cache, v_cache, meta = _paged_batch(gen, seqs, heads, kv_heads, dim, block_size, dtype)
    meta.prefills[1].mass_rows = 8  # an observation window of the chunk's last 8 queries
    meta.prefills[2].mass_rows = 70  # all of them, spelled out
    scale = 1 / math.sqrt(dim)
    got, got_mass = tops.paged_attention_mass(q, k_cache, v_cache, meta, scale)
    want, want_mass = reference.paged_attention_mass(q, k_cache, v_cache, meta, scale)
    tol = _tolerance(dtype)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_mass.decode, want_mass.decode, **tol)
    assert len(got_mass.prefill) == len(want_mass.prefill) == 3
    for chunk_got, chunk_want in zip(got_mass.prefill, want_mass.prefill, strict=True):
        torch.testing.assert_close(chunk_got, chunk_want, atol=tol["atol"] * 10, rtol=tol["rtol"])


# ---- quantized KV cache (int8 / fp8 with a scale per token and KV head) ----
KV_QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _quantized(cache: torch.Tensor, dtype: torch.dtype) -> kv_quant.QuantizedCache:
    return kv_quant.QuantizedCache(*kv_quant.quantize(cache, dtype))


@pytest.mark.parametrize("n,kv_heads,dim", [(1, 3, 64), (6, 1, 16), (11, 2, 24)])
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("kv_dtype", KV_QUANT_DTYPES)
def test_quantized_store_kv_matches_reference(n, kv_heads, dim, dtype, kv_dtype):
    gen = torch.Generator().manual_seed(n + dim)
    slots = 64
    kv = (3 * torch.randn(n, 2 * kv_heads * dim, generator=gen)).to(dtype)
    k, v = (t.view(n, kv_heads, dim) for t in kv.split(kv_heads * dim, dim=-1))  # strided
    k[0, 0] = 0  # an all-zero row: scale 0, stored as zeros
    slot_mapping = torch.randperm(slots, generator=gen)[:n]
    before = torch.randn(slots, kv_heads, dim, generator=gen)
    got = [_quantized(before, kv_dtype) for _ in range(2)]
    want = [_quantized(before, kv_dtype) for _ in range(2)]
    tops.store_kv(k, v, got[0], got[1], slot_mapping)
    reference.store_kv(k, v, want[0], want[1], slot_mapping)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.scale, w.scale, atol=0, rtol=1e-6)
        same = g.data.view(torch.uint8) == w.data.view(torch.uint8)
        if kv_dtype == torch.float8_e4m3fn:
            same |= _interpreter_fp8_rounding(g.data, w.data)
        assert bool(same.all())
    assert float(got[0].scale[slot_mapping[0], 0]) == 0.0
    assert not got[0].data[slot_mapping[0], 0].float().any()


def _interpreter_fp8_rounding(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where Triton 3.x's interpreter rounds to float8 differently from torch (GPUs convert in
    hardware): it rounds exact ties up instead of to even (one code apart; bfloat16 inputs
    have many ties), and when rounding up into the next power of two it loses the carry into
    an odd exponent (its numpy conversion ORs the overflowed mantissa bit into the exponent), so
    it stores half the right value."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    one_code_up = (g - w == 1) & ((g ^ w) & 0x80 == 0)
    power_of_two = (w & 0x07) == 0
    lost_carry = power_of_two & (got.float() * 2 == want.float()) & (want.float() != 0)
    return one_code_up | lost_carry


@pytest.mark.parametrize("kv_dtype", KV_QUANT_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,dtype", ATTENTION_CASES[:3])
def test_paged_attention_over_a_quantized_cache_matches_reference(heads, kv_heads, dim,
                                                                  block_size, dtype, kv_dtype):
    gen = torch.Generator().manual_seed(heads * 100 + dim + block_size)
    seqs = [(0, 1), (70, 1), (32, 1), (0, 13), (37, 29), (5, 70)]
    q, k_cache, v_cache, meta = _paged_batch(gen, seqs, heads, kv_heads, dim, block_size, dtype)
    meta.prefills[1].mass_rows = 8
    k_q, v_q = _quantized(k_cache, kv_dtype), _quantized(v_cache, kv_dtype)
    scale = 1 / math.sqrt(dim)
    got, got_mass = tops.paged_attention_mass(q, k_q, v_q, meta, scale)
    want, want_mass = reference.paged_attention_mass(q, k_q, v_q, meta, scale)
    tol = _tolerance(dtype)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(tops.paged_attention(q, k_q, v_q, meta, scale), want, **tol)
    torch.testing.assert_close(got_mass.decode, want_mass.decode, **tol)
    for chunk_got, chunk_want in zip(got_mass.prefill, want_mass.prefill, strict=True):
        torch.testing.assert_close(chunk_got, chunk_want, atol=tol["atol"] * 10, rtol=tol["rtol"])
    # Split decoding reads the scales the same way.
    out = torch.zeros_like(q)
    tops.decode_attention(q, k_q, v_q, meta, scale, out, splits=2)
    rows = meta.decode_token_index
    torch.testing.assert_close(out[rows], want[rows], **tol)


def test_attention_names_a_bad_cache_layout():
    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, meta = _paged_batch(gen, [(4, 1)], 2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="K and V caches in the same layout"):
        tops.paged_attention(q, k_cache, v_cache.transpose(1, 2).contiguous().transpose(1, 2),
                             meta, 1.0)


# ---- dispatch ----
def test_triton_is_refused_on_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need a CUDA device.*TRITON_INTERPRET=1"):
        kernels.ops_for("cpu", torch.float32, "triton")
    monkeypatch.setenv("SERVESCOPE_KERNELS", "triton")
    with pytest.raises(ValueError, match="need a CUDA device"):
        kernels.ops_for("cpu", torch.float32)


def test_dispatch_offers_triton_and_keeps_the_reference_on_the_cpu(monkeypatch):
    monkeypatch.delenv("SERVESCOPE_KERNELS", raising=False)
    assert "triton" in kernels.available_backends()
    # Triton is never picked on the CPU: bfloat16 gets oneDNN where its self-check passed.
    cpu_bf16 = "onednn" if torch.bfloat16 in kernels.ONEDNN_DTYPES else "reference"
    assert kernels.ops_for("cpu", torch.bfloat16).name == cpu_bf16
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = kernels.ops_for("cpu", torch.float32, "triton")
    assert ops.name == "triton"
    assert ops.paged_attention.__module__ == "kernels.triton_ops"
    # Matmuls stay with cuBLAS through torch: float weights are used as they are, not re-laid
    # out, and the product is torch's.
    w, x = torch.randn(5, 7), torch.randn(3, 7)
    assert ops.prepare_linear(w) is w
    torch.testing.assert_close(ops.linear(x, w), reference.linear(x, w))


def test_demo_model_layers_give_the_reference_logits_with_triton_kernels(demo_checkpoint):
    """The real weights through the runner's own metadata: fresh prefills, then one step with a
    chunk over cached keys and two padded decodes, with the KV-eviction statistics asked for.
    The first two layers only: the interpreter takes seconds per layer."""
    config = dataclasses.replace(demo_checkpoint.config, num_layers=2)
    tokens = torch.randint(config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    tables = [[3, 7, 1], [5], [0, 2]]
    steps = [
        [RunItem(tokens[0, :20].tolist(), 0, tables[0], 1),
         RunItem(tokens[1, :9].tolist(), 0, tables[1], 1),
         RunItem(tokens[2, :30].tolist(), 0, tables[2], 1, mass_rows=6)],
        [RunItem(tokens[0, 20:37].tolist(), 20, tables[0], 1),
         RunItem(tokens[1, 9:10].tolist(), 9, tables[1], 1),
         RunItem(tokens[2, 30:31].tolist(), 30, tables[2], 1)],
    ]
    logits, masses = {}, {}
    for backend in ("reference", "triton"):
        model = LlamaModel(config, demo_checkpoint.tensors, torch.device("cpu"), torch.float32,
                           64, backend)
        assert model.ops.name == backend
        runner = ModelRunner(model, BlockManager(8, 16))
        logits[backend], masses[backend] = [], []
        for items in steps:
            result = runner.run_items(items, all_logits=True, want_mass=True)
            logits[backend].append(result.logits)
            masses[backend].append(result.mass)
    for got, want in zip(logits["triton"], logits["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    for got, want in zip(masses["triton"], masses["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
