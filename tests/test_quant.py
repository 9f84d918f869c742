"""Weight-only quantization: round trips, packed ops vs the dequantize reference, GGUF blocks
against the gguf library, and the real demo model under int8 / int4."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kernels
from engine.quantize import WeightsError, parse_weights
from kernels import quant


def _weight(out: int, inp: int, seed: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(64, 96), (960, 576), (33, 200)])
@pytest.mark.parametrize("group", [None, 32, 64, 128])
def test_int8_round_trip_is_within_half_a_step(shape, group):
    w = _weight(*shape, seed=1)
    q = quant.quantize_int8(w, group)
    assert q.codes.dtype == torch.int8 and q.dequantize().shape == w.shape
    step = q.scales.repeat_interleave(q.group_size, dim=1)[:, : w.shape[1]]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("shape", [(64, 96), (960, 576), (33, 200)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step(shape, group):
    w = _weight(*shape, seed=2)
    q = quant.quantize_int4(w, group)
    # Two codes a byte; inputs padded to whole groups (576 is not a multiple of 128).
    assert q.codes.shape == (shape[0], q.padded_in // 2) and q.padded_in % group == 0
    step = q.scales.repeat_interleave(group, dim=1)[:, : w.shape[1]]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-5).all()
    # 16 levels over each group's range: the error is a few percent of the weights' spread.
    assert (q.dequantize() - w).std() < 0.1 * w.std()


def test_a_constant_group_survives():
    w = torch.zeros(4, 64)
    w[1] = 3.0
    for q in (quant.quantize_int8(w), quant.quantize_int4(w, 32)):
        torch.testing.assert_close(q.dequantize(), w)


def _linear_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # The packed ops take bfloat16 activations and scales (8-bit mantissa, relative rounding
    # 2^-9 each) and round their output to bfloat16: a few 2^-9 of sum |x| |w| per output.
    return 2**-6 * (x.abs() @ w.abs().T) + 1e-4


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 960, 576), (7, 576, 1536), (16, 128, 208)])
def test_packed_op_matches_the_dequantize_reference(bits, group, rows, out_f, in_f):
    available = quant.int8_packed_available() if bits == 8 else quant.int4_packed_available()
    if not available:
        pytest.skip("this PyTorch build has no packed CPU op for this format")
    w = _weight(out_f, in_f, seed=rows)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(in_f))
    b = torch.randn(out_f)
    q = quant.quantize_int8(w) if bits == 8 else quant.quantize_int4(w, group)
    packed = quant.prepare_packed(q)
    assert type(packed) is (quant.PackedInt8 if bits == 8 else quant.PackedInt4)
    got, want = packed.linear(x, b), q.linear(x, b)
    assert ((got - want).abs() <= _linear_tolerance(x, q.dequantize())).all()


@pytest.mark.parametrize("make", [lambda w: quant.quantize_int8(w[:, :200]),  # K % 16 != 0
                                  lambda w: quant.quantize_int4(w[:130], 32),  # N % 16 != 0
                                  lambda w: quant.quantize_int8(w, 32)])  # int8 in groups
def test_shapes_the_packed_ops_refuse_keep_the_fallback(make):
    q = make(_weight(160, 256, seed=4))
    assert quant.prepare_packed(q) is q
    x = torch.randn(16, q.in_features)
    torch.testing.assert_close(q.linear(x), x @ q.dequantize().T)


def test_dispatch_takes_quantized_weights_in_every_table():
    w, x = _weight(96, 64, seed=3), torch.randn(2, 64)
    q = quant.quantize_int4(w, 32)
    ref = kernels.ops_for("cpu", torch.float32, "reference")
    prepared = ref.prepare_linear(q)
    assert prepared is q  # the reference dequantizes per call
    torch.testing.assert_close(ref.linear(x, prepared), x @ q.dequantize().T)
    best = kernels.ops_for("cpu", torch.float32)
    got = best.linear(x, best.prepare_linear(q))
    assert ((got - x @ q.dequantize().T).abs() <= _linear_tolerance(x, q.dequantize())).all()


# ---- GGUF blocks ----
@pytest.fixture(scope="module")
def demo_reader(demo_gguf):
    return gguf.GGUFReader(demo_gguf)


@pytest.mark.parametrize("name,kind", [("token_embd.weight", "Q8_0"),
                                       ("blk.0.attn_q.weight", "Q4_1"),
                                       ("blk.3.ffn_down.weight", "Q4_1")])
def test_demo_blocks_import_equals_gguf_dequantization(demo_reader, name, kind):
    t = next(t for t in demo_reader.tensors if t.name == name)
    assert t.tensor_type.name == kind
    rows = t.data[:1024]  # the first 1,024 output rows keep the 49,152-row embedding quick
    q = quant.from_gguf_blocks(kind, rows, int(t.shape[0]))
    want = gguf.quants.dequantize(rows, t.tensor_type).reshape(q.out_features, q.in_features)
    assert q.group_size == 32 and q.bits == (8 if kind == "Q8_0" else 4)
    assert torch.equal(q.dequantize(), torch.from_numpy(want))  # bit for bit


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_written_by_gguf_import_exactly(kind):
    qtype = gguf.GGMLQuantizationType[kind]
    data = np.random.default_rng(0).standard_normal((48, 160)).astype(np.float32)
    raw = gguf.quants.quantize(data, qtype)
    q = quant.from_gguf_blocks(kind, raw, 160)
    assert torch.equal(q.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


def test_unknown_block_type_is_refused():
    with pytest.raises(ValueError, match="Q2_K"):
        quant.from_gguf_blocks("Q2_K", np.zeros((2, 84), np.uint8), 256)


# ---- the weights= choice ----
@pytest.mark.parametrize("value,name", [("float", "float"), (None, "float"), ("int8", "int8"),
                                        ("int4", "int4:g32"), ("INT4:g128", "int4:g128"),
                                        ("int8:g32", "int8:g32")])
def test_weight_formats_parse(value, name):
    assert parse_weights(value).name == name


@pytest.mark.parametrize("bad", ["int3", "int4:g48", "fp8", "int4:64", ""])
def test_bad_weights_value_is_one_clear_error(bad):
    if bad == "":
        assert parse_weights(bad).name == "float"  # empty means the default
        return
    with pytest.raises(WeightsError, match=f"Unknown weights format '{bad}'.*use float, int8"):
        parse_weights(bad)


def test_llm_refuses_a_bad_weights_value_before_reading_the_model():
    from engine import LLM

    with pytest.raises(WeightsError, match="'int2'"):
        LLM("/nonexistent/model.gguf", weights="int2")


# ---- the real demo model ----
_PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
           "Berlin is the capital of Germany. Water boils at one hundred degrees")


@pytest.fixture(scope="module")
def engines(demo_gguf):
    from engine import LLM

    return {w: LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=256, weights=w)
            for w in ("float", "int8", "int4")}


@pytest.fixture(scope="module")
def prompt_logits(engines):
    ids = engines["float"].tokenizer.encode(_PROMPT)
    return {w: llm.prompt_logits(ids) for w, llm in engines.items()}


@pytest.mark.parametrize("weights,min_top1,max_kl", [("int8", 0.9, 0.03), ("int4", 0.95, 0.01)])
def test_quantized_logits_stay_close_to_float32(prompt_logits, weights, min_top1, max_kl):
    # Measured on this prompt (31 positions): int8 top-1 agreement 0.97, mean KL 0.009 nats;
    # int4 1.0 and 0.002 (its g32 codes are the file's own Q4_1 blocks, so only the bfloat16
    # activations and the int8 head differ). The bounds leave ~3-4x room, no more.
    ref, got = prompt_logits["float"], prompt_logits[weights]
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    logp, logq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    assert top1 >= min_top1 and kl <= max_kl


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_greedy_chat_answer_is_real_text(engines, weights):
    from engine import SamplingParams

    llm = engines[weights]
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out.text
    assert llm.weights == {"int8": "int8", "int4": "int4:g32"}[weights]


def test_int4_g32_takes_the_files_q4_1_blocks_code_for_code(demo_checkpoint):
    from engine.model import LlamaModel

    model = LlamaModel(demo_checkpoint.config, demo_checkpoint.tensors, torch.device("cpu"),
                       torch.float32, 64, "reference", "int4", demo_checkpoint.blocks)
    assert model.weights_from_gguf_blocks == 4 * demo_checkpoint.config.num_layers
    t = demo_checkpoint.tensors
    p = "model.layers.5."
    qkv = torch.cat([t[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
    # Q/K rows un-permuted like the float loader's, values equal to the dequantized file.
    assert torch.equal(model.layers[5].qkv.dequantize(), qkv)
    assert torch.equal(model.layers[5].down.dequantize(), t[f"{p}mlp.down_proj.weight"])


def test_weight_bytes_shrink_and_match_the_estimate(engines, demo_gguf):
    from engine.memory import estimate_memory

    for w, llm in engines.items():
        assert estimate_memory(demo_gguf, weights=w).weight_bytes == llm.weight_bytes
    sizes = {w: llm.weight_bytes for w, llm in engines.items()}
    # The float32 embedding (113 MB) stays; the layers shrink 4x (int8) and ~7x (int4).
    assert sizes["int4"] < sizes["int8"] < 0.4 * sizes["float"]
