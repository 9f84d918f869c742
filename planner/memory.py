"""Memory per GPU: weights by precision, KV bytes per token, activations, reserve and fit."""

from __future__ import annotations

from dataclasses import dataclass

from planner.catalog import KV_PRECISIONS, PRECISIONS, Gpu, Model

GB = 1e9
# int4 weights carry one fp16 scale and one fp16 zero point per group of 128 (GPTQ/AWQ layout).
INT4_GROUP = 128
BYTES_PER_PARAM = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0,
                   "int4": 0.5 + 4.0 / INT4_GROUP}
KV_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0}
# aiconfigurator reserves 3.5 GB "other" (CUDA context, allocator slack, CUDA graphs) per GPU
# and 0.35-0.4 GB for NCCL buffers when the GPU talks to others.
RUNTIME_RESERVE_GB = 3.5
NCCL_RESERVE_GB = 0.4
# vLLM's default --gpu-memory-utilization: the rest stays free for fragmentation and spikes.
MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class MemoryPlan:
    """Where one GPU's memory goes for a model at a precision and parallel layout."""

    weights_gb: float
    activations_gb: float
    reserve_gb: float
    kv_gb: float
    usable_gb: float
    kv_bytes_per_token: float
    kv_tokens: int
    max_sequences: int
    fits: bool
    reason: str = ""
    context: int = 0  # the longest request the plan was sized for (tokens)

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.activations_gb + self.reserve_gb + max(self.kv_gb, 0.0)


def weight_bytes(model: Model, precision: str) -> float:
    """All weights at `precision` (embeddings included: vLLM quantizes or keeps them, ~1-3%)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown weight precision {precision!r}; choose from {PRECISIONS}")
    return model.params_b * 1e9 * BYTES_PER_PARAM[precision]


def kv_bytes_per_token(model: Model, kv_precision: str) -> float:
    """KV cache per token, whole model: 2·L·kv_heads·head_dim·bytes, or MLA's latent L·(r+rope)."""
    if kv_precision not in KV_PRECISIONS:
        raise ValueError(f"unknown KV precision {kv_precision!r}; choose from {KV_PRECISIONS}")
    if model.is_mla:
        return model.layers * (model.kv_lora_rank + model.qk_rope_dim) * KV_BYTES[kv_precision]
    return 2.0 * model.layers * model.kv_heads * model.head_dim * KV_BYTES[kv_precision]


def kv_bytes_per_token_per_gpu(model: Model, kv_precision: str, tp: int, pp: int,
                               dcp: int = 1) -> float:
    """One GPU's share: layers split by PP; heads split by TP until TP exceeds them (replicated).
    MLA's latent has no heads to split, so every TP rank holds it whole. Decode context
    parallelism then stripes each sequence's tokens over `dcp` of the TP ranks that would hold
    copies (vLLM 0.32: ModelConfig.get_num_kv_heads keeps max(1, kv_heads // TP) heads a rank,
    AttentionSpec.max_num_blocks_per_req allots a request cdiv(len, block_size * dcp) blocks)."""
    total = kv_bytes_per_token(model, kv_precision) / pp
    if model.is_mla:
        return total / dcp
    return total / min(tp, model.kv_heads) / dcp


def activation_bytes(model: Model, tokens: int, tp: int) -> float:
    """Peak activations of one forward pass of `tokens` tokens (bf16): the residual stream, the
    QKV output and the MLP's gate+up output, the largest tensors alive at once."""
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim / tp
    mlp = 2 * (model.moe_intermediate * model.experts_per_token if model.is_moe
               else model.intermediate) / tp
    logits = model.vocab / tp
    return 2.0 * tokens * (2 * model.hidden + qkv + mlp) + 4.0 * min(tokens, 256) * logits


def plan_memory(model: Model, gpu: Gpu, weights: str, kv: str, tp: int = 1, pp: int = 1,
                context: int = 4096, max_batched_tokens: int = 2048, dcp: int = 1) -> MemoryPlan:
    """Per-GPU memory split and how many sequences of `context` tokens the KV cache holds."""
    if tp < 1 or pp < 1:
        raise ValueError("tp and pp must be at least 1")
    weights_gb = weight_bytes(model, weights) / (tp * pp) / GB
    activations_gb = activation_bytes(model, max_batched_tokens, tp) / GB
    reserve_gb = RUNTIME_RESERVE_GB + (NCCL_RESERVE_GB if tp * pp > 1 else 0.0)
    usable_gb = gpu.memory_gb * MEMORY_UTILIZATION
    kv_gb = usable_gb - weights_gb - activations_gb - reserve_gb
    per_token = kv_bytes_per_token_per_gpu(model, kv, tp, pp, dcp)
    kv_tokens = int(max(kv_gb, 0.0) * GB // per_token)
    max_sequences = kv_tokens // max(context, 1)
    reason = ""
    if kv_gb <= 0:
        overhead = activations_gb + reserve_gb
        reason = (f"weights need {weights_gb:.1f} GB per GPU plus {overhead:.1f} GB of "
                  f"activations and reserve; {gpu.name} offers {usable_gb:.1f} GB")
    elif max_sequences < 1:
        reason = (f"KV cache holds {kv_tokens} tokens per replica, less than one {context}-token "
                  f"sequence")
    return MemoryPlan(weights_gb, activations_gb, reserve_gb, kv_gb, usable_gb, per_token,
                      kv_tokens, max_sequences, fits=not reason, reason=reason,
                      context=min(context, model.max_context))
