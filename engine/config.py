"""Model hyper-parameters shared by the loaders, the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class ModelError(ValueError):
    """A model input the user can fix: a bad path, a corrupt file, an unsupported architecture."""


class LoadCancelled(ModelError):
    """Loading was cancelled by the caller's progress callback; nothing stays loaded."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and hyper-parameters of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"Unsupported architecture '{self.architecture}': servescope runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models; pick a model of one of these."
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                f"({self.num_kv_heads}): the model file is inconsistent."
            )

    def kv_bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """K and V bytes one token occupies across all layers; a quantized cache stores
        `element_bytes` per number plus `scale_bytes` per head row (kernels/kv_quant.py)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * element_bytes
                                                          + scale_bytes)
