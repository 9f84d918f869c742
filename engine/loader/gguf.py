"""GGUF files through the gguf package: config, dequantized tensors under HF names, tokenizer."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelError
from engine.tokenizer import Tokenizer, byte_level_bpe, end_of_turn_ids, sentencepiece_bpe

# Errors the gguf reader raises on truncated or foreign files (bad magic, short arrays, ...).
if TYPE_CHECKING:  # torch is imported only when tensors are read
    import torch

_READ_ERRORS = (
    ValueError,
    IndexError,
    KeyError,
    OSError,
    struct.error,
    UnicodeDecodeError,
    OverflowError,
    TypeError,
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp permutes Q/K rows for its interleaved rope only when converting to the "llama"
# architecture (convert_hf_to_gguf LlamaModel.permute); qwen2 files keep HF's layout, and
# transformers' GGUF loader undoes the permutation for "llama" alone too.
_PERMUTED_ARCHITECTURES = ("llama",)


def load_gguf(path: Path, dtype: torch.dtype, progress=None):
    """Read a GGUF file into a Checkpoint (tensors dequantized to `dtype`)."""
    from engine.loader.checkpoint import Checkpoint

    reader = open_gguf(path)
    config = read_config(reader, path)
    tensors = read_tensors(reader, config, path, dtype, progress)
    tokenizer = read_tokenizer(reader, path)
    name = path.stem.lower()
    return Checkpoint(config, tensors, tokenizer, path, name, "gguf",
                      blocks=read_blocks(reader, config))


class _Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its file mapping: np.memmap runs a Python
    __array_finalize__ on every slice, and the parser slices about a million times for a
    tokenizer's vocabulary (the demo model's header reads in half the time; same bytes, the view
    keeps the mapping alive)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A GGUFReader, or ModelError naming the file when it is missing, cut short or not GGUF."""
    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist: check the path.")
    try:
        return _Reader(path)
    except _READ_ERRORS as exc:
        raise corrupt(path, exc) from exc


def corrupt(path: Path, exc: BaseException) -> ModelError:
    """One sentence for a file that is not GGUF at all, and one for a damaged GGUF file (the
    parser's own text, e.g. numpy's "index 0 is out of bounds", means nothing to a user)."""
    if not _has_gguf_magic(path):
        return ModelError(f"{path} is not a GGUF file: give a .gguf model file or a Hugging Face "
                          "model folder.")
    return ModelError(
        f"{path} starts like a GGUF file but cannot be read (cut short or damaged): copy or "
        "download it again (for the demo model run `servescope models fetch`)."
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def field(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value (scalar, string or list), or `default` when absent."""
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def read_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; unsupported architectures raise ModelError."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"Unsupported architecture '{arch}' in {path}: servescope runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models."
        )
    try:
        return _config(reader, arch, path)
    except (TypeError, KeyError) as exc:
        raise corrupt(path, exc) from exc


def _config(reader: gguf.GGUFReader, arch: str, path: Path) -> ModelConfig:
    def get(key: str, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise KeyError(f"missing {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelError(
            f"{path} applies rotary embeddings to {rope_dim} of {head_dim} head dimensions: "
            "servescope supports full rotary embeddings only."
        )
    names = {t.name: t for t in reader.tensors}
    embed = names.get("token_embd.weight")
    if embed is None:
        raise KeyError("no token_embd.weight tensor")
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    eos = end_of_turn_ids(tokens, field(reader, "tokenizer.ggml.token_type", []), _eos_keys(reader))
    name = str(field(reader, "general.name", "")).lower()
    return ModelConfig(
        architecture="mistral" if arch == "llama" and "mistral" in name else arch,
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
    )


def _eos_keys(reader: gguf.GGUFReader) -> list[int | None]:
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return [field(reader, f"tokenizer.ggml.{key}") for key in keys]


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict | None:
    # llama3-style scaling lives in the rope_freqs tensor, not here; these keys cover the
    # linear and yarn scalings llama.cpp's converter writes.
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling = {"rope_type": kind, "factor": float(factor)}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the engine does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of Q/K rows (weight [out, in] or bias [out])."""
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 with numpy shape (GGUF dims reversed)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    kind = tensor.tensor_type
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        # A copy: the reader's arrays are read-only views of the memory-mapped file.
        data = np.array(tensor.data, dtype=np.float32)
    else:
        data = gguf.quants.dequantize(tensor.data, kind)
    return data.reshape(shape)


def read_tensors(
    reader: gguf.GGUFReader, config: ModelConfig, path: Path, dtype: torch.dtype, progress=None
) -> dict[str, torch.Tensor]:
    """Dequantized tensors under HF names in the rotate_half rope convention."""
    import torch

    permuted = field(reader, "general.architecture") in _PERMUTED_ARCHITECTURES
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    tensors: dict[str, torch.Tensor] = {}
    for index, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(index / len(reader.tensors))
        name = hf_name(tensor.name)
        if name is None:
            continue
        try:
            array = dequantize(tensor)
        except _READ_ERRORS as exc:
            raise corrupt(path, exc) from exc
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            array = unpermute(array, heads[proj])
        keep = torch.float32 if name == "rope_freqs.weight" else dtype
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array)).to(keep)
    _check_complete(tensors, config, path)
    return tensors


def read_blocks(reader: gguf.GGUFReader, config: ModelConfig) -> dict:
    """The raw Q8_0 / Q4_0 / Q4_1 rows of each 2-D tensor under its HF name (memory-mapped
    views, Q/K rows in HF order), so weight-only quantization can take them code for code."""
    from engine.quantize import GGUFBlocks
    from kernels.quant import GGUF_KINDS

    permuted = field(reader, "general.architecture") in _PERMUTED_ARCHITECTURES
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    blocks = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or kind not in GGUF_KINDS or len(tensor.shape) != 2:
            continue
        rows = tensor.data  # [out, bytes per row]: a block row per output channel
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            rows = unpermute(rows, heads[proj])  # rows move whole, so the blocks move with them
        blocks[name] = GGUFBlocks(kind, rows, int(tensor.shape[0]))
    return blocks


def _check_complete(tensors: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    parts = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    needed += [f"model.layers.{i}.{p}.weight" for i in range(config.num_layers) for p in parts]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise corrupt(path, KeyError(f"{len(missing)} tensors missing, e.g. {missing[0]}"))


def read_tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer:
    """Rebuild the tokenizer llama.cpp would use from `tokenizer.*` metadata."""
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelError(f"{path} has no tokenizer vocabulary: use a GGUF that includes one.")
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if kind == "gpt2":
        backend = byte_level_bpe(
            tokens,
            field(reader, "tokenizer.ggml.merges", []),
            types,
            field(reader, "tokenizer.ggml.pre"),
            add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
            bos_token_id=bos,
        )
    elif kind == "llama":
        backend = sentencepiece_bpe(
            tokens,
            field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens)),
            types,
            add_space_prefix=bool(field(reader, "tokenizer.ggml.add_space_prefix", True)),
            add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", True)),
            bos_token_id=bos,
            unk_token_id=field(reader, "tokenizer.ggml.unknown_token_id", 0),
        )
    else:
        raise ModelError(
            f"{path} uses tokenizer type '{kind}': servescope reads 'gpt2' (byte-level BPE) and "
            "'llama' (sentencepiece) GGUF tokenizers."
        )
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=end_of_turn_ids(tokens, types, _eos_keys(reader)),
        chat_template=field(reader, "tokenizer.chat_template"),
    )
