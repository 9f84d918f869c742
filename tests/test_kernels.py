"""Kernel ops against plain dense math: the dispatch point, oneDNN linear, paged attention."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import AttentionMetadata, PrefillChunk, cpu_kernels, kv_quant, onednn, reference


def test_dispatch_picks_onednn_on_the_cpu_for_the_dtypes_it_checked():
    for dtype in (torch.float32, torch.bfloat16):
        expected = "onednn" if dtype in kernels.ONEDNN_DTYPES else "reference"
        assert kernels.ops_for("cpu", dtype).name == expected
        assert kernels.packs_linear_weights("cpu", dtype) == (expected == "onednn")
    assert kernels.ops_for("cpu", torch.float16).name == "reference"
    assert kernels.ops_for("cpu", torch.float32, "reference").name == "reference"
    assert not kernels.packs_linear_weights("cpu", torch.float32, "reference")
    with pytest.raises(ValueError, match="not available"):
        kernels.ops_for("cpu", torch.float32, "nonsense")
    if "onednn" in kernels.available_backends():
        with pytest.raises(ValueError, match="not float16 on cpu: use reference"):
            kernels.ops_for("cpu", torch.float16, "onednn")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif("avx512_bf16" not in _cpu_flags(), reason="no AVX512-BF16 on this CPU")
def test_a_cpu_with_bfloat16_instructions_gets_the_onednn_bfloat16_table():
    # The self-check must not quietly fail on the CPUs it is for (bfloat16 would fall back to
    # F.linear, 1.3-1.6x slower per layer there).
    assert torch.bfloat16 in kernels.ONEDNN_DTYPES
    assert kernels.ops_for("cpu", torch.bfloat16).name == "onednn"


@pytest.mark.skipif("onednn" not in kernels.available_backends(), reason="no oneDNN in torch")
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 64, 32), (5, 3072, 576), (77, 576, 1536)])
def test_onednn_linear_matches_reference(rows, out_f, in_f):
    ops = kernels.ops_for("cpu", torch.float32, "onednn")
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(out_f, in_f, generator=gen), torch.randn(out_f, generator=gen)
    x = torch.randn(rows, in_f, generator=gen)
    got = ops.linear(x, ops.prepare_linear(w), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-3, rtol=1e-4)


def _dense_attention(q, k, v, start, with_mass=False):
    """Causal attention for one sequence, queries at positions start.., keys 0..len-1; with
    `with_mass` also each key's probability summed per KV head over its query heads and queries."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    qpos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    if not with_mass:
        return out
    return out, probs.view(kv_heads, heads // kv_heads, *probs.shape[1:]).sum(dim=(1, 2))


def _paged_step(heads, kv_heads, block_size, dim=16, dtype=torch.float32, seed=0):
    """A step over a paged cache: two decodes, a fresh prefill and a later chunk, each
    sequence's blocks scattered over the cache. Returns q, the caches, the step's metadata, the
    dense attention's output and key masses per sequence, and each sequence's (context, new)."""
    gen = torch.Generator().manual_seed(seed)
    slots = 256
    k_cache = torch.zeros(slots, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros(slots, kv_heads, dim, dtype=dtype)
    seqs = [(10, 1), (3, 1), (0, 7), (9, 4)]
    free = list(torch.randperm(slots // block_size, generator=gen).tolist())
    qs, expected, slot_maps, meta_rows, prefills, masses = [], [], [], [], [], []
    row = 0
    for ctx, n in seqs:
        total = ctx + n
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        seq_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                                  for p in range(total)])
        # Values rounded to the cache's dtype first, so the dense oracle sees what is stored.
        k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype).float()
        v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype).float()
        k_cache[seq_slots[:ctx]] = k[:ctx].to(dtype)
        v_cache[seq_slots[:ctx]] = v[:ctx].to(dtype)
        q = torch.randn(n, heads, dim, generator=gen).to(dtype).float()
        qs.append((q, k[ctx:], v[ctx:]))
        out, mass = _dense_attention(q, k, v, ctx, with_mass=True)
        expected.append(out)
        masses.append(mass)
        slot_maps.append(seq_slots[ctx:])
        if n == 1:
            meta_rows.append((row, seq_slots))
        else:
            mask = None if ctx == 0 else (torch.arange(total).unsqueeze(0)
                                          <= torch.arange(ctx, total).unsqueeze(1))
            prefills.append(PrefillChunk(row, row + n, seq_slots, mask))
        row += n
    q = torch.cat([x[0] for x in qs]).to(dtype)
    reference.store_kv(torch.cat([x[1] for x in qs]).to(dtype),
                       torch.cat([x[2] for x in qs]).to(dtype),
                       k_cache, v_cache, torch.cat(slot_maps))
    longest = max(len(s) for _, s in meta_rows)
    padded = torch.zeros(len(meta_rows), longest, dtype=torch.long)
    for i, (_, s) in enumerate(meta_rows):
        padded[i, : len(s)] = s
    lengths = torch.tensor([len(s) for _, s in meta_rows])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_maps),
        decode_token_index=torch.tensor([r for r, _ in meta_rows]),
        decode_slots=padded,
        decode_mask=(torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1))[:, None, None],
        prefills=prefills,
    )
    return q, k_cache, v_cache, meta, expected, masses, seqs


def _decodes_alone(q, meta, seqs, expected):
    """The same step's decode rows as a decode-only step (its rows are the decode rows), and
    their dense output."""
    rows = meta.decode_token_index.tolist()
    alone = AttentionMetadata(slot_mapping=meta.slot_mapping[rows],
                              decode_token_index=torch.arange(len(rows)),
                              decode_slots=meta.decode_slots, decode_mask=meta.decode_mask)
    decode_expected = [e for (ctx, n), e in zip(seqs, expected, strict=True) if n == 1]
    return q[rows], alone, torch.cat(decode_expected)


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 4), (9, 3, 16), (8, 1, 5)])
def test_paged_attention_mixes_decode_and_chunks_like_dense(heads, kv_heads, block_size):
    dim = 16
    q, k_cache, v_cache, meta, expected, masses, seqs = _paged_step(
        heads, kv_heads, block_size, dim, seed=heads * 10 + block_size)
    out = reference.paged_attention(q, k_cache, v_cache, meta, 1 / math.sqrt(dim))
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)

    # The eviction statistics: same output, and each key's attention mass as the dense softmax.
    out, mass = reference.paged_attention_mass(q, k_cache, v_cache, meta, 1 / math.sqrt(dim))
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    decode_masses = [m for (ctx, n), m in zip(seqs, masses, strict=True) if n == 1]
    for got, want in zip(mass.decode, decode_masses, strict=True):
        torch.testing.assert_close(got[:, : want.shape[1]], want, atol=1e-5, rtol=1e-5)
        assert float(got[:, want.shape[1] :].abs().sum()) == 0.0
    chunk_masses = [m for (ctx, n), m in zip(seqs, masses, strict=True) if n > 1]
    for got, want in zip(mass.prefill, chunk_masses, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(mass.decode.sum()) == pytest.approx(heads * len(decode_masses), rel=1e-5)

    # A step of the decodes alone (its rows are the decode rows: attended without a gather).
    q_alone, alone, want = _decodes_alone(q, meta, seqs, expected)
    out = reference.paged_attention(q_alone, k_cache, v_cache, alone, 1 / math.sqrt(dim))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,block_size,dim",
                         [(9, 3, 16, 64), (8, 2, 5, 128), (4, 4, 4, 48), (6, 1, 16, 256)])
def test_the_cpu_kernels_kernel_attends_like_dense(heads, kv_heads, block_size, dim, dtype):
    """The C kernel on the specialised head dims (64, 128) and the general path, GQA and plain
    heads, blocks smaller than a vector: mixed with prefill chunks and alone, as dense math in
    float32 says (bfloat16: to its output rounding)."""
    assert cpu_kernels.available()  # built, and its self-check passed
    q, k_cache, v_cache, meta, expected, _, seqs = _paged_step(
        heads, kv_heads, block_size, dim, dtype, seed=dim + heads)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}
    scale = 1 / math.sqrt(dim)
    out = cpu_kernels.paged_attention(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), torch.cat(expected), **tol)
    q_alone, alone, want = _decodes_alone(q, meta, seqs, expected)
    got = cpu_kernels.decode_attention(q_alone, k_cache, v_cache, alone, scale)
    torch.testing.assert_close(got.float(), want, **tol)
    # The lengths the runner passes give the same answer as the mask they come from.
    alone.decode_lengths = alone.decode_mask.reshape(len(want), -1).sum(dim=1)
    assert torch.equal(cpu_kernels.decode_attention(q_alone, k_cache, v_cache, alone, scale),
                       got)


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 4, 48)])
def test_the_cpu_decode_attention_kernel_over_long_contexts_attends_like_dense(
        heads, kv_heads, dim, dtype):
    """Contexts across and off the kernel's blocks of keys (1, one vector of keys, one past it,
    a few hundred), keys at scattered slots, and scores far apart (some weights underflow to 0):
    each row as a float64 softmax says."""
    gen = torch.Generator().manual_seed(dim + heads)
    lengths = [1, 15, 16, 17, 47, 300]
    k_cache = torch.randn(1024, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(1024, kv_heads, dim, generator=gen).to(dtype)
    q = (torch.randn(len(lengths), heads, dim, generator=gen) * 25).to(dtype)
    slots = torch.stack([torch.randperm(1024, generator=gen)[: max(lengths)] for _ in lengths])
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), decode_slots=slots,
                             decode_lengths=torch.tensor(lengths))
    scale = 1 / math.sqrt(dim)
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, meta, scale).float()
    group = heads // kv_heads
    for row, length in enumerate(lengths):
        keys = k_cache[slots[row, :length]].double().repeat_interleave(group, dim=1)
        values = v_cache[slots[row, :length]].double().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,khd->hk", q[row].double(), keys) * scale).softmax(-1)
        assert float(probs.min()) < 1e-38 or length < 300  # weights below float32's range
        want = torch.einsum("hk,khd->hd", probs, values).float()
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
            {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(got[row], want, **tol)


def test_the_cpu_kernels_kernel_leaves_what_it_does_not_run_to_the_reference():
    """A head dim off its vector width and a quantized cache go to the torch path unchanged."""
    q, k_cache, v_cache, meta, expected, _, seqs = _paged_step(4, 2, 4, dim=20)
    out = cpu_kernels.paged_attention(q, k_cache, v_cache, meta, 20 ** -0.5)
    assert torch.equal(out, reference.paged_attention(q, k_cache, v_cache, meta, 20 ** -0.5))
    q, k_cache, v_cache, meta, expected, _, seqs = _paged_step(4, 2, 4, dim=64)
    k_quant, v_quant = (kv_quant.QuantizedCache(*kv_quant.quantize(c, torch.int8))
                        for c in (k_cache, v_cache))
    out = cpu_kernels.paged_attention(q, k_quant, v_quant, meta, 0.125)
    assert torch.equal(out, reference.paged_attention(q, k_quant, v_quant, meta, 0.125))


@pytest.mark.skipif(not onednn.available(), reason="this PyTorch build has no oneDNN linear ops")
@pytest.mark.parametrize("rows", [1, 16, 17, 129, 513, 2049])
def test_onednn_linear_at_row_buckets_gives_every_row_its_own_result(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    got = onednn.linear(x, onednn.prepare_linear(w), b)
    assert got.shape == (rows, 48)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def _assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                       b: torch.Tensor | None = None) -> None:
    """`got` (bfloat16) against F.linear in float32 on the same bfloat16 inputs: each output
    rounded to bfloat16 once (2^-9 relative) after float32 accumulation, so within 2^-8 of
    sum |x| |w| (+ |b|) per output; a wrong row or a dropped bias is far outside."""
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], w.shape[0])
    x, w = x.float(), w.float()
    want = F.linear(x, w, None if b is None else b.float())
    scale = x.abs() @ w.abs().T + (0 if b is None else b.float().abs())
    excess = (got.float() - want).abs() - 2**-8 * scale
    assert float(excess.max()) <= 0, f"off by up to {float(excess.max())} beyond the bound"


bf16_onednn = pytest.mark.skipif(torch.bfloat16 not in kernels.ONEDNN_DTYPES,
                                 reason="no oneDNN bfloat16 linear on this CPU / torch build")


@bf16_onednn
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 960, 576), (4, 3072, 576), (16, 576, 1536),
                                             (17, 64, 32), (129, 960, 576), (513, 48, 64)])
def test_onednn_bfloat16_linear_matches_float32_math_at_row_buckets(rows, out_f, in_f):
    ops = kernels.ops_for("cpu", torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_f, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
    prepared = ops.prepare_linear(w)
    _assert_bf16_close(ops.linear(x, prepared, b), x, w, b)
    _assert_bf16_close(ops.linear(x, prepared), x, w)


@bf16_onednn
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weights_run_through_the_bfloat16_table(bits):
    from kernels import quant

    ops = kernels.ops_for("cpu", torch.bfloat16)
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(64, 96, generator=gen)
    q = quant.quantize_int8(w) if bits == 8 else quant.quantize_int4(w, 32)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    # The packed int8 / int4 ops also round their scales to bfloat16: twice the bound's slack.
    got = ops.linear(x, ops.prepare_linear(q))
    want = q.linear(x.float())
    assert got.dtype == torch.bfloat16
    assert float(((got.float() - want).abs() - 2**-7 * (x.float().abs() @ q.dequantize().abs().T))
                 .max()) <= 0


def _tiny_tied_tensors(vocab: int = 80, hidden: int = 64, inter: int = 96) -> tuple:
    from engine.config import ModelConfig

    c = ModelConfig("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                    tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * 0.2  # noqa: E731
    shapes = {"self_attn.q_proj": (64, hidden), "self_attn.k_proj": (32, hidden),
              "self_attn.v_proj": (32, hidden), "self_attn.o_proj": (hidden, 64),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": torch.ones(hidden),
         p + "input_layernorm.weight": torch.ones(hidden),
         p + "post_attention_layernorm.weight": torch.ones(hidden)}
    t |= {f"{p}{name}.weight": rnd(*shape) for name, shape in shapes.items()}
    return c, t


@bf16_onednn
@pytest.mark.parametrize("weights", [None, "int8"])
def test_a_bfloat16_model_loads_through_onednn_with_its_tied_head_packed(weights):
    from engine.memory import estimate_for
    from engine.model import LlamaModel

    c, t = _tiny_tied_tensors()
    cpu = torch.device("cpu")
    fast = LlamaModel(c, t, cpu, torch.bfloat16, 64, weights=weights)
    plain = LlamaModel(c, t, cpu, torch.bfloat16, 64, "reference", weights=weights)
    assert fast.ops.name == "onednn"
    hidden = torch.randn(3, c.hidden_size, generator=torch.Generator().manual_seed(1))
    hidden = hidden.to(torch.bfloat16)
    got, want = fast.logits(hidden), plain.logits(hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    if weights is None:
        # The tied head is a second, packed matrix beside the embedding, as the estimate says.
        assert fast.lm_head is not fast.embed
        parameters = sum(v.numel() for v in t.values())
        estimate = estimate_for(c, parameters, "bfloat16", 64, 1)
        assert fast.weight_bytes == estimate.weight_bytes == plain.weight_bytes + 80 * 64 * 2


def test_row_buckets_bound_the_shapes_a_server_meets():
    buckets = [onednn.padded_rows(m) for m in range(1, 4097)]
    assert all(m <= p <= max(m + 7, m * 1.42) for m, p in enumerate(buckets, start=1))
    assert buckets[:16] == list(range(1, 17))  # decode batches run unpadded
    assert len(set(buckets[:2048])) <= 60


def test_without_a_working_compiler_decode_attention_runs_the_torch_path(tmp_path):
    """A machine whose C compiler fails (here: `false` as CC, an empty kernel cache) still
    decodes, through the reference's attention, and says why in its log."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from kernels import cpu_kernels, ops_for\n"
        "table = ops_for('cpu', torch.float32)\n"
        "from tests.test_kernels import _paged_step, _decodes_alone\n"
        "q, k, v, meta, expected, _, seqs = _paged_step(9, 3, 16, 64)\n"
        "q1, alone, want = _decodes_alone(q, meta, seqs, expected)\n"
        "out = table.paged_attention(q1, k, v, alone, 0.125)\n"
        "torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)\n"
        "print('available', cpu_kernels.available())\n"
    )
    env = {**os.environ, "CC": shutil.which("false") or "/bin/false",
           "SERVESCOPE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert "available False" in done.stdout
    assert "The CPU kernels did not build" in done.stderr
    assert not list(tmp_path.iterdir())  # no half-written library left behind


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
def test_a_new_build_prunes_builds_unused_for_a_month(tmp_path):
    """Each source edit, compiler or CPU leaves a build behind in the cache: a new build removes
    those not loaded for 30 days, and nothing else."""
    old, recent, other = (tmp_path / "cpu_kernels-0000000000000000.so",
                          tmp_path / "cpu_kernels-1111111111111111.so", tmp_path / "notes.txt")
    for path in (old, recent, other):
        path.write_bytes(b"x")
    month_ago = time.time() - 31 * 86400
    os.utime(old, (month_ago, month_ago))
    os.utime(other, (month_ago, month_ago))
    env = {**os.environ, "SERVESCOPE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "from kernels import cpu_kernels\n"
                           "print('built', cpu_kernels._library() is not None)"],
                          env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert "built True" in done.stdout, done.stderr
    left = {p.name for p in tmp_path.iterdir()}
    assert old.name not in left and {recent.name, other.name} <= left
    assert len([name for name in left if name.endswith(".so")]) == 2  # recent and the new one


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 576), (16, 576), (200, 960), (3, 32)])
def test_the_cpu_rms_norm_kernel_computes_the_reference(rows, width, dtype):
    """RMSNorm with and without the residual add, from decode rows to a prefill-sized block
    (threaded): the reference's values to its rounding, and the summed residual exactly."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    weight = torch.rand(width, generator=gen).to(dtype) + 0.5
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 1.6e-2, "rtol": 1.6e-2}
    for res in (None, residual):
        got, summed = cpu_kernels.rms_norm(x, weight, 1e-6, res)
        want, want_summed = reference.rms_norm(x, weight, 1e-6, res)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert torch.equal(summed, want_summed)  # one rounded add either way


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
@pytest.mark.parametrize("width,k", [(8192, 4), (8192, 1), (1000, 8), (17, 17), (49152, 64)])
def test_the_cpu_softmax_topk_kernel_ranks_like_torch(width, k):
    """The k most probable columns and their probabilities as torch's softmax and topk give
    them: peaked and flat rows, a width off the vector length, a strided view of wider rows;
    equal scores rank by column; a row with NaN, or with fewer than k finite scores, takes
    torch's path (so says what torch says)."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(width + k)
    wide = torch.randn(6, width + 5, generator=gen) * torch.tensor([[0.1], [1], [3], [8], [1],
                                                                    [1]])
    scores = wide[:, :width]  # rows of stride width + 5
    probs, cols = cpu_kernels.softmax_topk(scores, k)
    want = torch.softmax(scores, dim=-1).topk(k, dim=-1)
    assert torch.equal(cols, want.indices)
    torch.testing.assert_close(probs, want.values, rtol=2e-6, atol=1e-9)

    tied = torch.zeros(2, width)
    tied[0, width // 3] = tied[0, width // 2] = tied[0, width - 1] = 5.0
    probs, cols = cpu_kernels.softmax_topk(tied, k)
    top = sorted({width // 3, width // 2, width - 1})
    assert cols[0, : min(k, 3)].tolist() == top[: min(k, 3)]
    assert cols[1].tolist() == list(range(k))  # all equal: the first k columns
    torch.testing.assert_close(probs.sum(-1), torch.softmax(tied, -1).topk(k).values.sum(-1))

    odd = torch.randn(2, width, generator=gen)
    odd[0, width // 2] = float("nan")
    odd[1, 1:] = float("-inf")
    if k > 1:
        for got, want in zip(cpu_kernels.softmax_topk(odd, k),
                             reference.softmax_topk(odd, k), strict=True):
            torch.testing.assert_close(got, want, equal_nan=True)


def test_rotary_tables_hold_the_correctly_rounded_cos_and_sin_of_each_float32_angle():
    """Every entry is the float32 nearest the cos / sin of its float32 angle (position x
    inverse frequency), checked against Python's math at 3,000 scattered entries: a table of
    one rounding, so nothing about how torch split or vectorised the work can show in it (its
    float32 cos once gave the first engine of a process a table of its own)."""
    import random

    from engine.rope import cos_sin_tables

    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = cos_sin_tables(inv_freq, 8192)
    assert cos.shape == sin.shape == (8192, 64) and cos.dtype == sin.dtype == torch.float32
    pick = random.Random(3)
    for _ in range(3000):
        pos, col = pick.randrange(8192), pick.randrange(64)
        angle = float(torch.tensor(float(pos)) * inv_freq[col % 32])  # the float32 product
        assert float(cos[pos, col]) == float(torch.tensor(math.cos(angle))), (pos, col)
        assert float(sin[pos, col]) == float(torch.tensor(math.sin(angle))), (pos, col)


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,kv_heads,dim", [(1, 9, 3, 64), (16, 9, 3, 64),
                                                  (40, 32, 8, 128), (3, 4, 1, 32)])
def test_the_cpu_rotary_kernel_rotates_views_of_the_fused_qkv_like_the_reference(
        n, heads, kv_heads, dim, dtype):
    """q and k as the model passes them (views into one QKV row per token), rotated at real
    positions' angles; each product and sum rounded as the reference's ops round them."""
    assert cpu_kernels.available()
    from engine.rope import cos_sin_tables

    gen = torch.Generator().manual_seed(n * heads + dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = cos_sin_tables(inv_freq, 4096)
    positions = torch.randint(0, 4096, (n,), generator=gen)
    cos, sin = cos[positions].to(dtype), sin[positions].to(dtype)
    got_q, got_k = cpu_kernels.rotary(q, k, cos, sin)
    want_q, want_k = reference.rotary(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else \
        {"atol": 0.0, "rtol": 0.0}
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


@pytest.mark.skipif(cpu_kernels._library() is None,
                    reason="the C kernels did not build here (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 1536), (16, 1536), (100, 64)])
def test_the_cpu_swiglu_kernel_computes_the_reference(rows, width, dtype):
    """silu(gate) * up over gates from -60 to 60 (the exponential's far ends) and near 0."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, 2 * width, generator=gen) * 4
    x[0, :4] = torch.tensor([-60.0, 60.0, 0.0, -1e-3])
    x = x.to(dtype)
    got, want = cpu_kernels.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (rows, width)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
