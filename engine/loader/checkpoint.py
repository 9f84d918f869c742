"""What a loader returns: one Checkpoint, whatever the file format."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported only when weights are read (fast CLI and app start)
    import torch

Progress = Callable[[float], None]


@dataclass
class Checkpoint:
    """A model's config, HF-named tensors (rotate_half rope convention) and tokenizer."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    name: str
    format: str
    # GGUF only: quantized tensors' raw blocks by HF name (engine.quantize.GGUFBlocks), which
    # weight-only quantization takes as they are instead of re-quantizing the floats.
    blocks: dict = field(default_factory=dict, repr=False)
