"""Hugging Face folders: config.json + (sharded) safetensors + tokenizer.json."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError
from tokenizers import Tokenizer as Backend

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelError
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported only when tensors are read
    import torch

# Every supported architecture has these; qwen2 always has q/k/v biases.
_ALWAYS_BIASED = ("qwen2",)


def load_hf(folder: Path, dtype: torch.dtype, progress=None):
    """Read a Hugging Face model folder into a Checkpoint."""
    from engine.loader.checkpoint import Checkpoint

    if not folder.is_dir():
        raise ModelError(f"Model folder {folder} does not exist: check the path.")
    raw = read_json(folder / "config.json", folder, required=True)
    config = read_config(raw, folder)
    tensors = read_tensors(folder, dtype, progress)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tokenizer = read_tokenizer(folder, config)
    # The engine stops on the union the tokenizer gathered (config + generation_config + tokens).
    config = replace(
        config, eos_token_ids=tokenizer.eos_token_ids, bos_token_id=tokenizer.bos_token_id
    )
    return Checkpoint(config, tensors, tokenizer, folder, folder.name, "hf")


def read_json(path: Path, folder: Path, required: bool = False) -> dict:
    """A JSON object from the folder, {} when optional and absent; bad JSON is a ModelError."""
    if not path.is_file():
        if required:
            raise ModelError(
                f"{folder} has no {path.name}: a Hugging Face model folder needs config.json, "
                "tokenizer.json and *.safetensors weights."
            )
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}): repair or re-download it.") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path} does not hold a JSON object: repair or re-download it.")
    return data


def read_config(raw: dict, folder: Path) -> ModelConfig:
    """ModelConfig from a config.json dict (transformers 4 and 5 layouts)."""
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"Unsupported architecture '{arch}' in {folder}: servescope runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models."
        )
    try:
        return _config(raw, arch)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelError):
            raise
        raise ModelError(
            f"{folder}/config.json is incomplete or malformed ({exc!r}): re-download the model."
        ) from exc


def _config(raw: dict, arch: str) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    theta, scaling = rope_settings(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch in _ALWAYS_BIASED or bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=as_ids(raw.get("eos_token_id")),
    )


def rope_settings(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from `rope_theta`/`rope_scaling` or transformers 5's
    `rope_parameters`; scaling keeps the source dict, with `type` renamed `rope_type`."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = dict(raw.get("rope_scaling") or params)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def as_ids(value) -> tuple[int, ...]:
    """An eos id given as None, an int or a list, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder: single, or the shards named by the index."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = read_json(index_path, folder)
        names = sorted(set((index.get("weight_map") or {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing or not names:
            raise ModelError(
                f"{folder} lists weight shards that are not there ({', '.join(missing) or 'none'}):"
                " download the missing files."
            )
        return [folder / n for n in names]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelError(
            f"{folder} has no weights: a Hugging Face model folder needs model.safetensors "
            "(or sharded model-*.safetensors with model.safetensors.index.json)."
        )
    return shards


def read_tensors(
    folder: Path, dtype: torch.dtype, progress=None
) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, floating ones cast to `dtype`."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    files = weight_files(folder)
    for index, path in enumerate(files):
        if progress is not None:
            progress(index / len(files))
        try:
            part = load_file(path)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelError(
                f"{path} is not a readable safetensors file ({exc}): re-download it."
            ) from exc
        for name, tensor in part.items():
            tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return tensors


def read_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    """tokenizer.json plus template and special ids from the folder's JSON files."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelError(
            f"{folder} has no tokenizer.json: servescope needs the fast tokenizer file; "
            "re-download the model with it."
        )
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelError(f"{path} could not be read ({exc}): re-download it.") from exc
    tok_config = read_json(folder / "tokenizer_config.json", folder)
    generation = read_json(folder / "generation_config.json", folder)
    bos = _token_id(backend, tok_config.get("bos_token"))
    eos = as_ids(generation.get("eos_token_id")) + config.eos_token_ids
    eos += tuple(i for i in [_token_id(backend, tok_config.get("eos_token"))] if i is not None)
    if bos is None:
        bos = generation.get("bos_token_id", config.bos_token_id)
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos,
        chat_template=chat_template(folder, tok_config),
    )


def _token_id(backend: Backend, token) -> int | None:
    # tokenizer_config stores special tokens as strings or as AddedToken dicts.
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def chat_template(folder: Path, tok_config: dict) -> str | None:
    """The default chat template: chat_template.jinja (transformers 5) or tokenizer_config's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
