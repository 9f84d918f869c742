"""The CPU int4 / int8 kernels (kernels/cpu_quant.py, cpu_kernels.c's int4_linear and
int8_linear) against the dequantizing reference, in the dispatch table, and in the demo model."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_quant, quant


def _cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return any(line.startswith("flags") and f" {flag}" in line for line in info)
    except OSError:
        return False


def _has_avx512_bf16() -> bool:
    return _cpu_flag("avx512_bf16")


def _has_tile_isa() -> bool:
    """The instructions the weights' tile kernels are built for: AVX512-BF16, or AVX2 with FMA
    and F16C (x86 CPUs without AVX-512, such as Zen 2 and Zen 3 EPYCs)."""
    return _has_avx512_bf16() or all(_cpu_flag(f) for f in ("avx2", "fma", "f16c"))


def _has_amx() -> bool:
    return _cpu_flag("amx_bf16")


# Where the CPU has AVX512-BF16 or AVX2 (with FMA and F16C) and a compiler is present, the
# kernel must build and pass its self-check (a wrong build fails here rather than quietly
# leaving PyTorch's op in place).
needs_kernel = pytest.mark.skipif(not _has_tile_isa(),
                                  reason="the CPU lacks AVX512-BF16 and AVX2 with FMA and F16C")


def test_the_kernel_is_used_exactly_where_the_cpu_has_its_instructions():
    assert cpu_quant.available() == _has_tile_isa()


def _weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of different scales and offsets, as trained layers have.
    return torch.randn(out_f, in_f, generator=gen) * torch.rand(out_f, 1, generator=gen) \
        + 0.05 * torch.randn(out_f, 1, generator=gen)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Weights and activations rounded to bfloat16 (relative 2^-9 each), float32 sums, the
    # output rounded to bfloat16 where the activations are: a few 2^-9 of sum |x| |w|.
    return 2**-6 * (x.float().abs() @ w.abs().T) + 1e-4


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, cpu_quant.DEQUANTIZE_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx_path", [False, True], ids=["tile-loops", "amx-path"])
def test_int4_linear_computes_the_dequantize_reference(group, rows, dtype, amx_path):
    # 208 inputs: padded to whole groups of 64 and 128 (zero inputs meet the padding).
    # The AMX path: from AMX_MATMUL_ROWS rows of bfloat16 activations, int4_amx_linear (each
    # pair of weight tiles decoded into cache); float32 activations keep the other paths.
    if amx_path and not _has_amx():
        pytest.skip("the CPU lacks AMX")
    out_f, in_f = 96, 208 if group > 32 else 192
    q = quant.quantize_int4(_weight(out_f, in_f, seed=rows), group)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(group)).to(dtype)
    bias = torch.randn(out_f, generator=torch.Generator().manual_seed(rows)).to(dtype)
    weight = cpu_quant.prepare(q)
    assert isinstance(weight, cpu_quant.Int4Linear)
    weight.matmul_rows = cpu_quant.AMX_MATMUL_ROWS if amx_path else 0
    got = weight.linear(x, bias)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    want = q.linear(x.float(), bias.float())
    assert ((got.float() - want).abs() <= _bound(x, q.dequantize())).all()


def _int4_times_q16(x: torch.Tensor, q: quant.QuantizedWeight) -> torch.Tensor:
    """What the AVX2 int4 kernel computes (cpu_kernels.c, rows_to_q16 and avx2_w4a16_rows): each
    row's bfloat16 activations quantized to int16 per block of 32 inputs (d = max|x| / 32767,
    q = round(x / d)), exact integer sums of codes times q per block, then per block
    scale * d * sum + min * (the block's sum of x), with the float16 scales and mins the
    kernel holds."""
    xb = torch.nn.functional.pad(x.to(torch.bfloat16).float(), (0, q.padded_in - x.shape[1]))
    blocks = xb.view(x.shape[0], -1, 32).double()
    amax = blocks.abs().amax(-1, keepdim=True).float()
    full = torch.full_like(amax, 32767.0)  # a tensor: torch's scalar / tensor is not exact
    inv = torch.where(amax > 0, full / amax, 0.0)
    qx = torch.round((blocks.float() * inv).double())
    codes = q.int_codes().double().view(q.out_features, -1, 32)
    sums = torch.einsum("rbk,obk->rob", qx, codes)  # integers: exact in float64
    per_block = q.group_size // 32
    scales = q.scales.half().double().repeat_interleave(per_block, dim=1)  # [out, blocks]
    mins = q.mins.half().double().repeat_interleave(per_block, dim=1)
    d = (amax / full).double().squeeze(-1)  # [rows, blocks]
    return (scales[None] * d[:, None] * sums + mins[None] * blocks.sum(-1)[:, None]).sum(-1)


@pytest.mark.skipif(not _has_tile_isa() or _has_avx512_bf16(),
                    reason="the AVX2 build of the int4 kernel runs on CPUs without AVX512-BF16")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 40])
def test_on_avx2_int4_weights_multiply_16_bit_activations_in_integers(group, rows):
    # Activations with an outlier per row, as a layer's inputs have: a block's other inputs
    # keep fewer levels, which the reference models exactly.
    out_f, in_f = 64, 256
    q = quant.quantize_int4(_weight(out_f, in_f, seed=group + rows), group)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=gen)
    x[:, 5] *= 20
    x = x.to(torch.bfloat16).float()  # float32 activations: outputs unrounded
    weight = cpu_quant.prepare(q)
    got = weight.linear(x).double()
    # The kernel's float32 terms (each a few roundings of float32) in its own order.
    magnitude = x.abs() @ q.dequantize().abs().T
    assert ((got - _int4_times_q16(x, q)).abs() <= 2**-20 * magnitude + 1e-6).all()
    # And 16-bit activations give the exact product of the weights as held (float16 scales and
    # mins, as a GGUF Q4_1 block has them) but for their rounding: half a 32767th of each
    # block's largest activation per input (2^-16), times the weights.
    held = quant.QuantizedWeight(q.codes, q.scales.half().float(), q.mins.half().float(), 4,
                                 q.group_size, q.in_features)
    exact = held.linear(x).double()
    amax = x.view(rows, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    assert ((got - exact).abs() <= 2**-16 * amax @ held.dequantize().abs().T
            + 2**-20 * magnitude + 1e-5).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("in_f", [96, 95])  # an odd input count is padded with a zero code
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_computes_the_dequantize_reference(rows, in_f, dtype):
    q = quant.quantize_int8(_weight(48, in_f, seed=rows))
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(in_f)).to(dtype)
    weight = cpu_quant.prepare(q)
    assert isinstance(weight, cpu_quant.Int8Linear)
    got = weight.linear(x)
    assert got.dtype == dtype and got.shape == (rows, 48)
    want = q.linear(x.float())
    assert ((got.float() - want).abs() <= _bound(x, q.dequantize())).all()


@needs_kernel
def test_the_kernels_hold_the_footprint_the_memory_estimate_counts():
    from engine.quantize import matrix_bytes

    w = _weight(96, 192, seed=9)
    assert cpu_quant.prepare(quant.quantize_int8(w)).nbytes == matrix_bytes(96, 192, 8, None, True)
    for group in (32, 64):
        assert cpu_quant.prepare(quant.quantize_int4(w, group)).nbytes == matrix_bytes(
            96, 192, 4, group, True)


@needs_kernel
@pytest.mark.parametrize("make", [lambda w: quant.quantize_int4(w, 32), quant.quantize_int8])
def test_an_empty_batch_gives_an_empty_result(make):
    weight = cpu_quant.prepare(make(_weight(32, 64, seed=4)))
    assert weight.linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


@needs_kernel
@pytest.mark.parametrize("out_f", [64, 352])  # 4 and 22 tiles of 16 outputs
@pytest.mark.parametrize("make", [lambda w: quant.quantize_int4(w, 32), quant.quantize_int8],
                         ids=["int4", "int8"])
def test_rows_in_a_batch_do_not_change_each_others_results(out_f, make):
    # Every row goes through the same tile code whatever else is in the batch (decode rows
    # batched with others must get the logits they get alone), below the row counts where the
    # weight is decoded whole (DEQUANTIZE_ROWS; on a CPU with AMX, AMX_MATMUL_ROWS: the decoded
    # weight rounds otherwise): rows in full blocks of 8, and the rows of a last, partial
    # block (on AVX512-BF16 several tiles take 1-4 of them at once; on AVX2 each row's
    # activations are quantized on their own). The 33 rows here stand for a batch of decodes,
    # so the AMX path is held off. int8 weights (the int4 formats' LM head) the same way.
    weight = cpu_quant.prepare(make(_weight(out_f, 128, seed=7)))
    weight.matmul_rows = 0
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    together = weight.linear(x)  # rows 0-31 in full blocks
    for i in (0, 15, 16, 32):
        assert torch.equal(weight.linear(x[i : i + 1])[0], together[i])
    for start, stop in ((0, 2), (5, 8), (3, 7), (10, 19), (1, 11), (0, 12), (4, 25)):
        assert torch.equal(weight.linear(x[start:stop]), together[start:stop]), (start, stop)


@needs_kernel
def test_the_decoded_weight_is_the_reference_in_bfloat16():
    q = quant.quantize_int4(_weight(48, 256, seed=3), 64)
    decoded = cpu_quant.prepare(q).dequantize()
    want = q.dequantize()
    assert decoded.dtype == torch.bfloat16
    # The output's bfloat16 rounding, and the float16 scales and mins (2^-11 each) the kernel
    # holds, as a GGUF Q4_1 block does.
    held = (q.mins.abs() + 15 * q.scales).repeat_interleave(64, dim=1)
    assert ((decoded.float() - want).abs() <= 2**-8 * want.abs() + 2**-10 * held).all()


@needs_kernel
def test_the_amx_path_is_taken_exactly_where_the_cpu_has_amx():
    weight = cpu_quant.prepare(quant.quantize_int4(_weight(32, 64, seed=6), 32))
    assert weight.matmul_rows == (cpu_quant.AMX_MATMUL_ROWS if _has_amx() else 0)
    weight = cpu_quant.prepare(quant.quantize_int8(_weight(32, 64, seed=6)))
    assert weight.matmul_rows == (cpu_quant.INT8_AMX_ROWS if _has_amx() else 0)
    # Inputs that are not whole A tiles of 32 keep the int8 loop.
    assert cpu_quant.prepare(quant.quantize_int8(_weight(32, 80, seed=6))).matmul_rows == 0


@pytest.mark.skipif(not _has_amx(), reason="the CPU lacks AMX")
@pytest.mark.parametrize("make", [lambda w: quant.quantize_int4(w, 32), quant.quantize_int8],
                         ids=["int4", "int8"])
def test_the_amx_kernels_agree_with_the_tile_loops_on_the_demo_models_shapes(make):
    # The LM head's and a layer's shapes, at row counts on both sides of the switch: each
    # pair of weight tiles decoded into cache and multiplied on the tile units gives the
    # reference's values as the tile loop does.
    for out_f, in_f in ((1024, 576), (576, 1536)):
        q = make(_weight(out_f, in_f, seed=out_f))
        weight = cpu_quant.prepare(q)
        for rows in (1, 2, 7, 8, 16, 23):
            x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            got = weight.linear(x)
            assert ((got.float() - q.linear(x.float())).abs() <= _bound(x, q.dequantize())).all()


@needs_kernel
@pytest.mark.skipif(not _has_amx(), reason="the CPU lacks AMX")
def test_float32_activations_keep_the_int4_loops_sums_below_dequantize_rows():
    # The AMX path decodes the weight to bfloat16 values and rounds as the bfloat16 kernels do;
    # float32 activations keep the int4 loop's sums until DEQUANTIZE_ROWS, as without AMX.
    weight = cpu_quant.prepare(quant.quantize_int4(_weight(64, 128, seed=2), 32))
    x = torch.randn(cpu_quant.AMX_MATMUL_ROWS + 1, 128, generator=torch.Generator().manual_seed(3))
    weight.matmul_rows = 0
    tiles = weight.linear(x)
    weight.matmul_rows = cpu_quant.AMX_MATMUL_ROWS
    assert torch.equal(weight.linear(x), tiles)
    assert not torch.equal(weight.linear(x.to(torch.bfloat16)).float(), tiles)


def test_shapes_the_kernel_does_not_take_keep_the_other_paths():
    w = _weight(130, 128, seed=5)
    assert cpu_quant.prepare(quant.quantize_int4(w, 32)) is None  # outputs not whole tiles
    assert cpu_quant.prepare(quant.quantize_int8(w[:128], 32)) is None  # int8 in groups
    huge = quant.quantize_int4(w[:128] * 1e6, 32)  # scales beyond float16
    assert cpu_quant.prepare(huge) is None


@needs_kernel
def test_the_cpu_table_runs_int4_weights_through_the_kernel():
    ops = kernels.ops_for("cpu", torch.bfloat16)
    q = quant.quantize_int4(_weight(64, 96, seed=1), 32)
    assert isinstance(ops.prepare_linear(q), cpu_quant.Int4Linear)
    assert ops.prepare_linear(quant.quantize_int4(_weight(40, 96, seed=1), 32)) is not None


@needs_kernel
def test_a_compact_weight_is_int4_in_the_kernel_and_float_where_it_cannot_be():
    # What a speculative draft's matrices become (engine/spec/hidden_draft.py): int4 through
    # the kernel, under a third of the bytes (codes, and float16 scales and mins per 32), the
    # product within int4's rounding of the float one.
    ops = kernels.ops_for("cpu", torch.bfloat16)
    w = _weight(64, 96, seed=7).to(torch.bfloat16)
    compact = ops.prepare_compact_linear(w)
    assert isinstance(compact, cpu_quant.Int4Linear)
    assert compact.nbytes < w.numel() * w.element_size() / 3
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = x.float() @ w.float().T
    got = ops.linear(x, compact).float()
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    # A shape the kernel does not take (40 outputs) and the reference table: as prepare_linear.
    odd = _weight(40, 96, seed=7).to(torch.bfloat16)
    assert torch.equal(ops.linear(x, ops.prepare_compact_linear(odd)),
                       ops.linear(x, ops.prepare_linear(odd)))
    reference = kernels.ops_for("cpu", torch.bfloat16, "reference")
    assert reference.prepare_compact_linear(w) is w


@needs_kernel
def test_a_compiled_function_calls_the_kernels_through_their_custom_ops():
    int4 = cpu_quant.prepare(quant.quantize_int4(_weight(64, 96, seed=2), 32))
    int8 = cpu_quant.prepare(quant.quantize_int8(_weight(64, 96, seed=3)))
    x = torch.randn(4, 96).to(torch.bfloat16)

    def step(t):
        return int4.linear(t) * 2 + int8.linear(t)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))


_PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
           "Berlin is the capital of Germany. Water boils at one hundred degrees")


@needs_kernel
def test_the_demo_model_in_int4_reads_like_pytorchs_int4_op(demo_gguf, monkeypatch):
    # The file's own Q4_1 codes (and the int8 head) through the kernels and through PyTorch's
    # packed ops, bfloat16 activations in both: the logits of a real prompt agree but for
    # roundings.
    from engine import LLM

    ours = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=256,
               weights="int4")
    assert isinstance(ours.model.layers[0].qkv, cpu_quant.Int4Linear)
    assert isinstance(ours.model.lm_head, cpu_quant.Int8Linear)  # int8 under every format
    monkeypatch.setattr(cpu_quant, "prepare", lambda q: None)
    theirs = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=256,
                 weights="int4")
    assert isinstance(theirs.model.layers[0].qkv, quant.PackedInt4)
    assert isinstance(theirs.model.lm_head, quant.PackedInt8)
    assert_reads_like(ours, theirs)


def assert_reads_like(ours, theirs) -> None:
    """Two engines' logits over a real prompt agree but for roundings: the same top token at 90%
    of positions, KL divergence at most 0.01 nats."""
    ids = ours.tokenizer.encode(_PROMPT)
    got, want = ours.prompt_logits(ids), theirs.prompt_logits(ids)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    logp, logq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    assert top1 >= 0.9 and kl <= 0.01
