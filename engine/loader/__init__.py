"""Model loaders: GGUF files and Hugging Face folders into one Checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.loader.checkpoint import Checkpoint, Progress
from engine.models import name_for_path, resolve_model

if TYPE_CHECKING:  # torch is imported only when weights are read (fast CLI and app start)
    import torch

__all__ = ["Checkpoint", "Progress", "load_checkpoint"]


def load_checkpoint(model: str | Path, dtype: torch.dtype | None = None,
                    progress: Progress | None = None) -> Checkpoint:
    """Load a GGUF file, a Hugging Face folder or a known model name (see engine.models).

    `progress(fraction)` is called as tensors are read; it may raise LoadCancelled to stop.
    """
    import torch

    dtype = dtype or torch.float32
    path = resolve_model(model)
    if path.is_dir():
        from engine.loader.hf import load_hf

        checkpoint = load_hf(path, dtype, progress)
    else:
        from engine.loader.gguf import load_gguf

        checkpoint = load_gguf(path, dtype, progress)
    checkpoint.name = name_for_path(path)
    return checkpoint
