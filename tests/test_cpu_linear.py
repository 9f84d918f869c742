"""The CPU's bfloat16 tile kernel (kernels/cpu_linear.py, cpu_kernels.c's bf16_linear) against
F.linear on the same bfloat16 values, in the dispatch table, and in the demo model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_linear, onednn
from tests.test_cpu_quant import (
    _has_amx,
    _has_avx512_bf16,
    _has_tile_isa,
    _weight,
    assert_reads_like,
    needs_kernel,
)


def test_the_kernel_runs_exactly_where_the_cpu_has_its_instructions():
    # AVX512-BF16, or AVX2 with FMA and F16C; and the CPU table picks the tile layout there;
    # where the CPU has AMX too, the AMX kernel must run (oneDNN, which uses AMX, beats the tile
    # loop, so without it oneDNN would stay).
    assert cpu_linear.available() == _has_tile_isa()
    assert cpu_linear.amx_runs() == (_has_avx512_bf16() and _has_amx())
    assert cpu_linear.preferred() == _has_tile_isa()


# Where the CPU table picks the tile layout (AVX512-BF16, AVX2).
picked = pytest.mark.skipif(not cpu_linear.preferred(),
                            reason="the CPU table keeps oneDNN for bfloat16 weights here")


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # bfloat16 products summed in float32 in another order than F.linear's, the bias added, the
    # output rounded to bfloat16 (2^-9 relative): a few 2^-9 of sum |x| |w| + |bias|.
    scale = x.float().abs() @ w.float().abs().T
    if bias is not None:
        scale = scale + bias.float().abs()
    return 2**-7 * scale + 1e-4


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 300])
@pytest.mark.parametrize("in_f", [96, 95, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_linear_computes_f_linear(rows, in_f, dtype):
    # Row counts below, at and across the 16-row blocks; an odd input count (padded to a pair).
    w = _weight(48, in_f, seed=rows).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(in_f)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    weight = cpu_linear.Bf16Linear(w)
    got = weight.linear(x, bias)
    assert got.dtype == dtype and got.shape == (rows, 48)
    want = F.linear(x.to(torch.bfloat16).float(), w.float(), bias.float())
    assert ((got.float() - want).abs() <= _bound(x, w, bias)).all()
    assert torch.equal(weight.dense(), w)


@needs_kernel
@pytest.mark.parametrize("kernel", ["bf16_linear", "bf16_amx_linear"])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 300])
@pytest.mark.parametrize("out_f", [48, 64])  # an odd and an even number of 16-output tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_tile_kernel_computes_f_linear(kernel, rows, out_f, dtype):
    # The AVX512-BF16 loop and, where the CPU has AMX, the AMX kernel, each called directly on
    # the same tile layout (inputs in whole A tiles of 32: what Bf16Linear pads to for AMX).
    if kernel == "bf16_amx_linear" and not cpu_linear.amx_runs():
        pytest.skip("the CPU lacks AMX")
    w = _weight(out_f, 96, seed=rows).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(out_f)
    bias = torch.randn(out_f, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    got = cpu_linear._tiles_forward(x, cpu_linear.tile_layout(w), bias, kernel)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    want = F.linear(x.to(torch.bfloat16).float(), w.float(), bias.float())
    assert ((got.float() - want).abs() <= _bound(x, w, bias)).all()


@needs_kernel
def test_a_batch_of_leading_dimensions_keeps_its_shape():
    weight = cpu_linear.Bf16Linear(_weight(32, 64, seed=1).to(torch.bfloat16))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got = weight.linear(x)
    assert got.shape == (3, 5, 32)
    torch.testing.assert_close(got[1], weight.linear(x[1]))


@needs_kernel
def test_an_empty_batch_gives_an_empty_result():
    weight = cpu_linear.Bf16Linear(_weight(32, 64, seed=4).to(torch.bfloat16))
    assert weight.linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


@needs_kernel
@pytest.mark.parametrize("out_f", [64, 176])  # 4 and 11 tiles of 16 outputs
def test_rows_in_a_batch_do_not_change_each_others_results(out_f):
    # Every row's sums run in the same order whatever else is in the batch, so a decode row
    # batched with others gets the logits it gets alone (oneDNN's blocking does not promise it):
    # rows in a full block of 16, and the rows of a last, partial block, which several tiles take
    # at once (1-4 rows: 4 tiles, 5-8: 2), the tiles left over one at a time.
    weight = cpu_linear.Bf16Linear(_weight(out_f, 128, seed=7).to(torch.bfloat16))
    bias = torch.randn(out_f, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    together = weight.linear(x, bias)  # rows 0-287 in full blocks
    for i in (0, 15, 16, 32, 299):
        assert torch.equal(weight.linear(x[i : i + 1], bias)[0], together[i])
    for start, stop in ((10, 27), (0, 3), (0, 20), (5, 29), (0, 13), (40, 89)):
        assert torch.equal(weight.linear(x[start:stop], bias), together[start:stop]), (start, stop)
    want = F.linear(x.float(), weight.dense().float(), bias.float())
    assert ((together.float() - want).abs() <= _bound(x, weight.dense(), bias)).all()


def test_weights_the_kernel_does_not_take_keep_onednns_layout():
    assert cpu_linear.prepare(_weight(40, 64, seed=5).to(torch.bfloat16)) is None  # 40 outputs
    assert cpu_linear.prepare(_weight(32, 64, seed=5)) is None  # float32
    if onednn.available(torch.bfloat16):
        ops = kernels.ops_for("cpu", torch.bfloat16)
        packed = ops.prepare_linear(_weight(40, 64, seed=5).to(torch.bfloat16))
        assert isinstance(packed, torch.Tensor)  # oneDNN's packed weight
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        assert ops.linear(x, packed).shape == (3, 40)


def test_where_onednn_has_no_bfloat16_the_cpu_table_keeps_such_weights_for_f_linear():
    # An AVX2 CPU: the table serves bfloat16 for the tile kernel; a weight the kernel does not
    # take (40 outputs) is multiplied by F.linear as it is.
    if onednn.available(torch.bfloat16) or torch.bfloat16 not in kernels.ONEDNN_DTYPES:
        pytest.skip("oneDNN runs bfloat16 here, or the CPU table does not serve it")
    ops = kernels.ops_for("cpu", torch.bfloat16)
    w = _weight(40, 64, seed=5).to(torch.bfloat16)
    plain = ops.prepare_linear(w)
    assert isinstance(plain, kernels.PlainLinear) and plain.nbytes == 40 * 64 * 2
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    torch.testing.assert_close(ops.linear(x, plain), F.linear(x, w))


@picked
def test_the_cpu_table_runs_bfloat16_weights_through_the_kernel():
    ops = kernels.ops_for("cpu", torch.bfloat16)
    w = _weight(64, 96, seed=1).to(torch.bfloat16)
    prepared = ops.prepare_linear(w)
    assert isinstance(prepared, cpu_linear.Bf16Linear)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(64, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), bias.float())
    assert ((ops.linear(x, prepared, bias).float() - want).abs() <= _bound(x, w, bias)).all()
    # float32 weights keep oneDNN's packed layout.
    assert isinstance(kernels.ops_for("cpu", torch.float32).prepare_linear(w.float()),
                      torch.Tensor)


@needs_kernel
def test_a_compiled_function_calls_the_kernel_through_its_custom_op():
    weight = cpu_linear.Bf16Linear(_weight(64, 96, seed=2).to(torch.bfloat16))
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(64, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16)

    def step(t):
        return weight.linear(t, bias) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))


def test_turning_the_c_kernels_off_leaves_onednn_or_the_reference(monkeypatch):
    # SERVESCOPE_CPU_KERNELS=0 (or no compiler) leaves no library: bfloat16 weights then take
    # oneDNN's packed layout, never a kernel that is not there.
    monkeypatch.setattr(cpu_linear, "_library", lambda: None)
    cpu_linear.available.cache_clear()
    cpu_linear.preferred.cache_clear()
    try:
        assert cpu_linear.available() is False
        assert cpu_linear.preferred() is False
        assert cpu_linear.prepare(_weight(32, 64, seed=3).to(torch.bfloat16)) is None
    finally:
        cpu_linear.available.cache_clear()
        cpu_linear.preferred.cache_clear()


@picked
def test_the_demo_model_in_bfloat16_reads_like_onednn(demo_gguf, monkeypatch):
    # The same bfloat16 weights through the tile kernel and through oneDNN's packed matmul (or,
    # where oneDNN has no bfloat16 path, F.linear): the logits of a real prompt agree but for
    # roundings, and the memory held is the same.
    from engine import LLM

    ours = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=256)
    assert isinstance(ours.model.layers[0].qkv, cpu_linear.Bf16Linear)
    assert isinstance(ours.model.lm_head, cpu_linear.Bf16Linear)
    monkeypatch.setattr(cpu_linear, "prepare", lambda weight: None)
    theirs = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=256)
    assert isinstance(theirs.model.layers[0].qkv,
                      torch.Tensor if onednn.available(torch.bfloat16) else kernels.PlainLinear)
    assert ours.model.weight_bytes == theirs.model.weight_bytes
    assert_reads_like(ours, theirs)
