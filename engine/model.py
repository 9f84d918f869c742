"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2) over a flat batch of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig, ModelError
from engine.quantize import GGUFBlocks, WeightFormat, WeightQuantizer, parse_weights
from engine.rope import cos_sin_tables, inv_frequencies
from kernels import AttentionMetadata, ops_for
from kernels.quant import QuantizedWeight


@dataclass
class LayerWeights:
    """One decoder layer's weights, with Q/K/V and gate/up fused into single matrices.

    The matmul weights are float tensors or, under a quantized weight format, whatever the
    kernel table's prepare_linear made of them (its linear takes either).
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor | QuantizedWeight
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | QuantizedWeight
    post_norm: torch.Tensor
    gate_up: torch.Tensor | QuantizedWeight
    down: torch.Tensor | QuantizedWeight


class LlamaModel:
    """Weights plus the forward pass; no nn.Module, so each step pays as little Python as possible.

    Sequences are concatenated into one flat batch of N tokens; the attention op finds each
    token's keys in the paged cache through the step's `AttentionMetadata`.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, max_positions: int,
                 kernel_backend: str | None = None, weights: str | WeightFormat | None = None,
                 blocks: dict[str, GGUFBlocks] | None = None) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.ops = ops_for(device.type, dtype, kernel_backend)
        self.weight_format = parse_weights(weights)
        quantizer = (WeightQuantizer(self.weight_format, blocks)
                     if self.weight_format.quantized else None)
        take = _Taker(tensors, device, dtype, quantizer)
        self.embed = take("model.embed_tokens.weight")
        self.layers = [_layer(take, config, i) for i in range(config.num_layers)]
        self.norm = take("model.norm.weight")
        head = take.head(self.embed)
        self._prepare_linears(head)
        # Bytes held, as prepared: a tied head re-laid out or quantized is a second matrix
        # beside the embedding (whose lookup needs the original).
        self.weight_bytes = sum(weight_nbytes(w) for w in self._weights())
        self.weights_from_gguf_blocks = 0 if quantizer is None else quantizer.from_blocks
        freq_factors = tensors.get("rope_freqs.weight")
        self.inv_freq = inv_frequencies(config, freq_factors).to(device)  # float32
        cos, sin = cos_sin_tables(self.inv_freq.cpu(), max_positions)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        self.scale = config.head_dim ** -0.5
        # The decode step's layers in one kernel call, where the table has one for these
        # weights (else None: forward's loop runs every step).
        self.decode_stack = self.ops.prepare_decode_stack(self.layers, {
            "hidden": config.hidden_size, "heads": config.num_heads,
            "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "intermediate": config.intermediate_size, "eps": config.rms_norm_eps,
            "scale": self.scale})

    def _prepare_linears(self, head: torch.Tensor) -> None:
        """Put every matmul weight in the layout the kernel backend wants."""
        prep = self.ops.prepare_linear
        for layer in self.layers:
            layer.qkv, layer.o = prep(layer.qkv), prep(layer.o)
            layer.gate_up, layer.down = prep(layer.gate_up), prep(layer.down)
        self.lm_head = prep(head)

    def _weights(self) -> list:
        held = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            held += [layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.post_norm,
                     layer.gate_up, layer.down]
        return [w for w in held if w is not None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                masses: list | None = None, ops=None,
                streams: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states after the final norm for every token of the flat batch ([N, hidden]).

        With `meta.want_mass`, each layer's AttentionMass (KV-eviction statistics) is appended
        to `masses`. `ops` replaces the model's kernel table for this pass (the compiled decode
        step's, kernels/compiled.py). `streams` (layer count -> None) is filled with the residual
        stream after that many layers ([N, hidden], the model's dtype): the middle layers a
        draft reads (EAGLE-3's features).
        """
        c, ops = self.config, ops or self.ops
        n = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        h = F.embedding(input_ids, self.embed)
        fused = (self.decode_stack.run(h, cos, sin, meta, kv_caches, streams)
                 if self.decode_stack is not None and ops is self.ops else None)
        if fused is not None:
            h, residual = fused
            h, _ = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual)
            return h
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches,
                                                            strict=True)):
            x, residual = ops.rms_norm(h, layer.input_norm, c.rms_norm_eps, residual)
            qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = ops.rotary(q.view(n, c.num_heads, c.head_dim),
                              k.view(n, c.num_kv_heads, c.head_dim), cos, sin)
            ops.store_kv(k, v.view(n, c.num_kv_heads, c.head_dim), k_cache, v_cache,
                         meta.slot_mapping)
            if meta.want_mass:
                attn, mass = ops.paged_attention_mass(q, k_cache, v_cache, meta, self.scale)
                masses.append(mass)
            else:
                attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
            h = ops.linear(attn.reshape(n, q_size), layer.o)
            x, residual = ops.rms_norm(h, layer.post_norm, c.rms_norm_eps, residual)
            h = ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up)), layer.down)
            if streams is not None and i + 1 in streams:
                streams[i + 1] = (h.float() + residual.float()).to(h.dtype)
        h, _ = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in float32 for the given hidden states."""
        return self.ops.linear(hidden, self.lm_head).float()


class _Taker:
    """Moves checkpoint tensors to the device and dtype, naming any that are missing."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, quantizer: WeightQuantizer | None = None) -> None:
        self.tensors, self.device, self.dtype = tensors, device, dtype
        self.quantizer = quantizer

    def __call__(self, *names: str) -> torch.Tensor:
        self._check(names)
        parts = [self.tensors[n] for n in names]
        t = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
        return t.to(self.device, self.dtype).contiguous()

    def linear(self, *names: str) -> torch.Tensor | QuantizedWeight:
        """A matmul weight (rows of `names` stacked): float, or in the quantizer's format."""
        if self.quantizer is None:
            return self(*names)
        self._check(names)
        return self.quantizer.linear(names, self.tensors, self.device)

    def head(self, embed: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        """The LM head: the embedding when tied; quantized (int8) whenever the layers are."""
        name = "lm_head.weight" if "lm_head.weight" in self.tensors else None
        if self.quantizer is not None:
            source = self.tensors[name or "model.embed_tokens.weight"]
            return self.quantizer.head(source, self.device)
        return embed if name is None else self(name)

    def _check(self, names) -> None:
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ModelError(f"The model file has no tensor '{missing[0]}': it is incomplete or "
                             "not a Llama-family checkpoint.")

    def optional(self, *names: str) -> torch.Tensor | None:
        return self(*names) if all(n in self.tensors for n in names) else None


def weight_nbytes(weight) -> int:
    """Bytes of a float tensor, or of a quantized weight in whatever form it was prepared."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.nbytes


def _layer(take: _Taker, config: ModelConfig, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
    return LayerWeights(
        input_norm=take(p + "input_layernorm.weight"),
        qkv=take.linear(*(a + ".weight" for a in attn)),
        qkv_bias=take.optional(*(a + ".bias" for a in attn)) if config.attention_bias else None,
        o=take.linear(p + "self_attn.o_proj.weight"),
        post_norm=take(p + "post_attention_layernorm.weight"),
        gate_up=take.linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        down=take.linear(p + "mlp.down_proj.weight"),
    )
