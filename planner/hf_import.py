"""Models from a Hugging Face config.json: architecture fields and a computed parameter count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.catalog import CatalogError, Model


def count_params(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, vocab: int, qkv_bias: bool = False) -> float:
    """Parameters of a Llama-style dense decoder with untied embeddings (GQA, SwiGLU)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    bias = head_dim * (heads + 2 * kv_heads) if qkv_bias else 0
    mlp = 3 * hidden * intermediate
    per_layer = attention + bias + mlp + 2 * hidden
    return float(layers * per_layer + 2 * vocab * hidden + hidden)


def _field(config: dict[str, Any], path: Path, *names: str, default: Any = None) -> Any:
    for name in names:
        if name in config:
            value = config[name]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CatalogError(f"{path}: field {name!r} must be a positive integer")
            return value
    if default is None:
        raise CatalogError(f"{path}: missing field {names[0]!r}")
    return default


def _moe(config: dict[str, Any], path: Path, layers: int) -> dict[str, int]:
    experts = config.get("num_local_experts") or config.get("n_routed_experts") or 0
    if not experts:
        return {}
    first_dense = config.get("first_k_dense_replace", 0)
    return {
        "experts": experts,
        "experts_per_token": _field(config, path, "num_experts_per_tok"),
        "shared_experts": config.get("n_shared_experts") or 0,
        "moe_intermediate": config.get("moe_intermediate_size")
        or _field(config, path, "intermediate_size"),
        "moe_layers": layers - first_dense,
    }


def _moe_params(arch: dict[str, Any], moe: dict[str, int],
                dense_params: float) -> tuple[float, float]:
    """(total, active) parameters: MoE layers swap their dense MLP for routed + shared experts."""
    if not moe:
        return dense_params, dense_params
    expert = 3.0 * arch["hidden"] * moe["moe_intermediate"]
    dense_mlp = 3.0 * arch["hidden"] * arch["intermediate"]
    base = dense_params - moe["moe_layers"] * dense_mlp
    total = base + moe["moe_layers"] * expert * (moe["experts"] + moe["shared_experts"])
    active = base + moe["moe_layers"] * expert * (moe["experts_per_token"] + moe["shared_experts"])
    return total, active


def model_from_hf_config(path: Path, name: str | None = None) -> Model:
    """A catalog Model from a config.json (Llama, Qwen2, Mistral, Mixtral, DeepSeek-V2/V3)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CatalogError(f"{path}: expected a JSON object")
    heads = _field(config, path, "num_attention_heads")
    hidden = _field(config, path, "hidden_size")
    arch = {
        "layers": _field(config, path, "num_hidden_layers"),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _field(config, path, "num_key_value_heads", default=heads),
        "head_dim": _field(config, path, "head_dim", "v_head_dim", default=hidden // heads),
        "intermediate": _field(config, path, "intermediate_size"),
        "vocab": _field(config, path, "vocab_size"),
    }
    qkv_bias = bool(config.get("attention_bias")) or "qwen2" in str(config.get("model_type"))
    moe = _moe(config, path, arch["layers"])
    total, active = _moe_params(arch, moe, count_params(**arch, qkv_bias=qkv_bias))
    mla = {}
    if config.get("kv_lora_rank"):
        mla = {"kv_lora_rank": config["kv_lora_rank"],
               "qk_rope_dim": config.get("qk_rope_head_dim", 0)}
    label = name or config.get("_name_or_path") or path.parent.name
    try:
        return Model(name=str(label), params_b=total / 1e9, active_params_b=active / 1e9,
                     max_context=config.get("max_position_embeddings", 4096),
                     source=f"imported from {path}", date="", **arch, **moe, **mla)
    except ValueError as exc:
        raise CatalogError(f"{path}: {exc}") from exc


def model_from_architecture(name: str, source: str, layers: int, hidden: int, heads: int,
                            kv_heads: int, head_dim: int, intermediate: int, vocab: int,
                            max_context: int = 4096, qkv_bias: bool = False) -> Model:
    """A Model from a loaded checkpoint's architecture: the local engine's model, so its
    benchmark can calibrate the planner ("calibrate from this workstation"). Counted with
    untied embeddings like every catalog model: a tied checkpoint still reads the matrix as
    its LM head each step."""
    arch = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "intermediate": intermediate, "vocab": vocab}
    params = count_params(**arch, qkv_bias=qkv_bias) / 1e9
    return Model(name=name, params_b=params, active_params_b=params, max_context=max_context,
                 source=source, date="", **arch)
