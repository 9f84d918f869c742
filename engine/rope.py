"""Rotary position embedding tables, including Llama 3's frequency scaling."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.config import ModelConfig, ModelError


def inv_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, [head_dim / 2]) under the model's rope scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif kind != "default":
        raise ModelError(
            f"Rope scaling '{kind}' is not supported: servescope handles default, linear and "
            "llama3 scaling; use a model without it."
        )
    if freq_factors is not None:
        # GGUF llama3 files carry the scaling precomputed as per-pair divisors.
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position ([max_positions, head_dim]) in the rotate_half layout.

    The angles are float32 products as the reference implementations compute them; their cos
    and sin are taken by NumPy in float64 and rounded once to float32, not by torch's float32
    cos: in about one process in six, the first engine's table (torch's first cos call in the
    process, split over two threads) came out different in the main thread's half, by enough
    to move 1.8% of its bfloat16 entries a unit, so two engines of one process gave different
    greedy replies (seen in speculative.py's control, diagnosed with a table comparison)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1).double().cpu().numpy()
    return (torch.from_numpy(np.cos(emb)).float().to(inv_freq.device),
            torch.from_numpy(np.sin(emb)).float().to(inv_freq.device))
