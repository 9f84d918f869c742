"""Loading GGUF files and Hugging Face folders against transformers' own loaders."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from engine.config import ModelError
from engine.loader import load_checkpoint
from engine.loader.gguf import unpermute

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)
REFERENCE_LAYERS = 4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


# --- the demo GGUF ---


@pytest.fixture(scope="session")
def hf_gguf_state_dict(demo_gguf):
    """transformers' dequantized (and un-permuted) state dict of the demo GGUF, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The skeleton only supplies parameter names; transformers reads head counts for its
    # un-permute from the file itself. Its first REFERENCE_LAYERS layers keep the name mapping
    # (which costs transformers ~0.2 s per module) short.
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=REFERENCE_LAYERS,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(str(demo_gguf), return_tensors=True, model_to_load=skeleton)
    return parsed["tensors"]


def test_demo_config(demo_checkpoint, demo_gguf):
    c = demo_checkpoint.config
    assert (c.architecture, c.num_layers, c.hidden_size) == ("llama", 30, 576)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.intermediate_size, c.vocab_size) == (1536, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1
    assert demo_checkpoint.name == "smollm2-135m-instruct"
    assert demo_checkpoint.format == "gguf" and demo_checkpoint.source == demo_gguf


def test_demo_tensors_equal_transformers(demo_checkpoint, hf_gguf_state_dict):
    ours = demo_checkpoint.tensors
    assert len(ours) == 2 + 9 * 30
    assert len(hf_gguf_state_dict) == 2 + 9 * REFERENCE_LAYERS
    for name, tensor in hf_gguf_state_dict.items():
        assert torch.equal(ours[name], tensor), name
    assert "lm_head.weight" not in ours  # tied
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert all(tensor.dtype == torch.float32 for tensor in ours.values())


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute(permute(w, 8), 8), w)
    b = np.arange(64, dtype=np.float32)
    assert np.array_equal(unpermute(permute(b, 4), 4), b)


# --- GGUF files written here from tiny HF models (the llama.cpp conversion, F32) ---


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model, path, arch: str):
    """Convert a tiny HF model to GGUF the way llama.cpp does (Q/K permuted for llama only)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    alphabet = [chr(c) for c in range(ord("!"), ord("!") + cfg.vocab_size - 2)]
    writer.add_token_list([*alphabet, "<|im_start|>", "<|im_end|>"])
    writer.add_token_types([1] * (cfg.vocab_size - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(cfg.vocab_size - 1)
    names = {v: k for k, v in _gguf_names(cfg.num_hidden_layers).items()}
    for name, tensor in model.state_dict().items():
        if name not in names:
            continue
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = _permute(array, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            array = _permute(array, cfg.num_key_value_heads)
        writer.add_tensor(names[name], array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_names(layers: int) -> dict[str, str]:
    from engine.loader.gguf import hf_name

    parts = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    parts += ["attn_norm", "ffn_norm"]
    names = [f"blk.{i}.{p}.weight" for i in range(layers) for p in parts]
    names += [f"blk.{i}.{p}.bias" for i in range(layers) for p in ("attn_q", "attn_k", "attn_v")]
    names += ["token_embd.weight", "output_norm.weight", "output.weight"]
    return {n: hf_name(n) for n in names}


def tiny_model(kind: str, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY, **extra)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**TINY, **extra)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_gguf_round_trips_to_hf_weights(arch, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = tiny_model(arch)
    path = write_gguf(model, tmp_path / f"tiny-{arch}.gguf", arch)
    checkpoint = load_checkpoint(path)
    reference = model.state_dict()
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, reference[name]), name
    assert set(reference) - set(checkpoint.tensors) == set()
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    for name, tensor in theirs.items():
        assert torch.equal(tensor, checkpoint.tensors[name]), name
    config = checkpoint.config
    assert config.architecture == arch and config.attention_bias == (arch == "qwen2")
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert not config.tie_word_embeddings
    assert checkpoint.tokenizer.eos_token_ids == (511,)
    assert checkpoint.tokenizer.encode("<|im_start|>!#") == [510, 0, 2]
    half = load_checkpoint(path, dtype=torch.bfloat16)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert half.tensors[name].dtype == torch.bfloat16
    assert torch.equal(half.tensors[name], reference[name].to(torch.bfloat16))


# --- Hugging Face folders ---


def save_hf(model, folder, tokenizer, **save_kwargs):
    model.save_pretrained(folder, **save_kwargs)
    tokenizer.save(folder)
    return folder


def assert_same_tensors(checkpoint, model):
    reference = model.state_dict()
    if model.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(checkpoint.tensors) == set(reference)
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, reference[name]), name


def test_hf_llama_with_llama3_rope(tmp_path, demo_checkpoint):
    model = tiny_model("llama", rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0)
    folder = save_hf(model, tmp_path / "tiny-llama", demo_checkpoint.tokenizer)
    checkpoint = load_checkpoint(folder)
    assert_same_tensors(checkpoint, model)
    c = checkpoint.config
    assert c.architecture == "llama" and c.rope_scaling == LLAMA3_ROPE
    assert c.rope_theta == 500000.0 and c.head_dim == 16 and c.num_kv_heads == 2
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.vocab_size) == (64, 128, 2, 512)
    assert not c.attention_bias and c.max_position_embeddings == 256
    assert checkpoint.format == "hf" and checkpoint.name == "tiny-llama"
    text = "Hello 123 🙂"
    assert checkpoint.tokenizer.encode(text) == demo_checkpoint.tokenizer.encode(text)
    assert checkpoint.tokenizer.chat_template == demo_checkpoint.tokenizer.chat_template


def test_hf_qwen2_sharded(tmp_path, demo_checkpoint):
    model = tiny_model("qwen2", tie_word_embeddings=True)
    folder = save_hf(model, tmp_path / "qwen", demo_checkpoint.tokenizer, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    checkpoint = load_checkpoint(folder)
    assert_same_tensors(checkpoint, model)
    c = checkpoint.config
    assert c.architecture == "qwen2" and c.attention_bias and c.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in checkpoint.tensors


def test_hf_legacy_config_keys(tmp_path, demo_checkpoint):
    # transformers 4 wrote rope_theta / rope_scaling {"type": ...} and eos lists.
    model = tiny_model("llama")
    folder = save_hf(model, tmp_path / "legacy", demo_checkpoint.tokenizer)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(
        rope_theta=1234.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        eos_token_id=[2, 0],
        head_dim=None,
    )
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    c = load_checkpoint(folder).config
    assert c.rope_theta == 1234.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.head_dim == 16
    assert c.eos_token_ids == (7, 2, 0)


# --- bad input ---


def test_missing_path():
    with pytest.raises(ModelError, match="does not exist"):
        load_checkpoint("/nonexistent/model.gguf")


@pytest.mark.parametrize("kind", ["truncated", "gguf-garbage", "random", "text"])
def test_corrupt_gguf(kind, tmp_path, demo_gguf):
    path = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        with demo_gguf.open("rb") as src:
            path.write_bytes(src.read(demo_gguf.stat().st_size // 2))
    elif kind == "gguf-garbage":
        path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(1 << 16))
    else:
        path.write_text("this is not a model\n")
    with pytest.raises(ModelError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message
    # The parser's own words (numpy's "index 0 is out of bounds", "GGUF magic invalid") are
    # nothing a user can act on; a file that is no GGUF at all is not worth downloading again.
    assert "index" not in message and "magic" not in message
    if kind in ("truncated", "gguf-garbage"):
        assert "servescope models fetch" in message
    else:
        assert "is not a GGUF file" in message and "download" not in message


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="Unsupported architecture 'gpt2'") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "llama, mistral, qwen2" in str(info.value)


def test_folder_without_weights(tmp_path, demo_checkpoint):
    model = tiny_model("llama")
    folder = save_hf(model, tmp_path / "noweights", demo_checkpoint.tokenizer)
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(ModelError, match="has no weights") as info:
        load_checkpoint(folder)
    assert str(folder) in str(info.value)


def test_folder_without_config(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(ModelError, match="has no config.json") as info:
        load_checkpoint(folder)
    assert str(folder) in str(info.value)


def test_folder_with_gpt2_config(tmp_path, demo_checkpoint):
    folder = save_hf(tiny_model("llama"), tmp_path / "gpt2ish", demo_checkpoint.tokenizer)
    raw = json.loads((folder / "config.json").read_text())
    raw["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="Unsupported architecture 'gpt2'") as info:
        load_checkpoint(folder)
    assert str(folder) in str(info.value)


def test_folder_with_broken_config(tmp_path, demo_checkpoint):
    folder = save_hf(tiny_model("llama"), tmp_path / "broken", demo_checkpoint.tokenizer)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ModelError, match="not valid JSON") as info:
        load_checkpoint(folder)
    assert "broken" in str(info.value)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelError, match="incomplete or malformed"):
        load_checkpoint(folder)


def test_folder_missing_shard(tmp_path, demo_checkpoint):
    model = tiny_model("llama")
    folder = save_hf(model, tmp_path / "shards", demo_checkpoint.tokenizer, max_shard_size="40KB")
    first = sorted(folder.glob("model-*.safetensors"))[0]
    shutil.move(first, tmp_path / first.name)
    with pytest.raises(ModelError, match=first.name):
        load_checkpoint(folder)
