"""Weight formats for `LLM(weights=...)`: parse the choice and build each matmul's weight.

"float" keeps the checkpoint's floats; "int8" is int8 per output channel; "int4" is int4 in
groups of 32 inputs ("int4:g64", "int4:g128" for larger groups); "int8:g32" etc. is int8 in
groups. Only the decoder layers' matmuls follow the format: the embedding and the norms stay
float, and the LM head, the most sensitive matmul and the largest, is int8 per channel under
every quantized format (llama.cpp's Q4 files likewise keep the output matrix at 6-8 bits).
A GGUF tensor whose blocks already have the asked layout (Q4_0 / Q4_1 for int4:g32, Q8_0 for
int8:g32) is taken code for code; anything else is quantized from its float values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when weights are built (the CLI and app parse first)
    import torch

    from kernels.quant import QuantizedWeight

WEIGHT_CHOICES = ("float", "int8", "int4", "int4:g64", "int4:g128")
GROUP_SIZES = (32, 64, 128)  # kernels.quant.GROUP_SIZES, repeated so parsing needs no torch
_FORMAT_RE = re.compile(r"(int8|int4)(?::g(\d+))?")
_FROM_GGUF = {(4, 32): ("Q4_0", "Q4_1"), (8, 32): ("Q8_0",)}


class WeightsError(ValueError):
    """A `weights=` value the engine does not know."""


@dataclass(frozen=True)
class WeightFormat:
    """How the decoder's matmul weights are stored: float, or int bits with a group size."""

    bits: int | None = None  # None: float
    group_size: int | None = None  # None: one scale per output channel

    @property
    def name(self) -> str:
        if self.bits is None:
            return "float"
        return f"int{self.bits}" + ("" if self.group_size is None else f":g{self.group_size}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None


def parse_weights(value: str | WeightFormat | None) -> WeightFormat:
    """A WeightFormat from "float", "int8", "int8:gN", "int4" (= int4:g32) or "int4:gN"."""
    if isinstance(value, WeightFormat):
        return value
    text = (value or "float").strip().lower()
    if text in ("float", "fp", "none"):
        return WeightFormat()
    match = _FORMAT_RE.fullmatch(text)
    group = None if match is None or match.group(2) is None else int(match.group(2))
    if match is None or (group is not None and group not in GROUP_SIZES):
        raise WeightsError(
            f"Unknown weights format '{value}': use float, int8 (per channel), int4 (groups of "
            "32), or int4:g64 / int4:g128 / int8:g32 / int8:g64 / int8:g128.")
    bits = int(match.group(1)[3:])
    if bits == 4 and group is None:
        group = 32
    return WeightFormat(bits, group)


@dataclass
class GGUFBlocks:
    """A quantized GGUF tensor's raw rows ([out, bytes], rows already in HF order)."""

    kind: str  # "Q8_0" | "Q4_0" | "Q4_1" (other kinds are not kept)
    rows: object  # numpy uint8 array
    in_features: int


class WeightQuantizer:
    """Builds quantized matmul weights for one format, from GGUF blocks where they fit."""

    def __init__(self, fmt: WeightFormat, blocks: Mapping[str, GGUFBlocks] | None = None) -> None:
        self.fmt = fmt
        self.blocks = blocks or {}
        self.from_blocks = 0  # how many matrices came straight from GGUF blocks

    def linear(self, names: Sequence[str], tensors: Mapping[str, torch.Tensor],
               device: torch.device) -> QuantizedWeight:
        """The fused matrix of `names` (rows stacked) in this format, on `device`."""
        import torch

        q = self._from_gguf(names)
        if q is None:
            q = self._quantize(torch.cat([tensors[n].float().cpu() for n in names], dim=0))
        else:
            self.from_blocks += 1
        return q.to(device)

    def head(self, weight: torch.Tensor, device: torch.device) -> QuantizedWeight:
        """The LM head: int8 per output channel whatever the layers' format (see the module)."""
        from kernels import quant

        return quant.quantize_int8(weight.float().cpu()).to(device)

    def _quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        from kernels import quant

        if self.fmt.bits == 8:
            return quant.quantize_int8(weight, self.fmt.group_size)
        return quant.quantize_int4(weight, self.fmt.group_size)

    def _from_gguf(self, names: Sequence[str]) -> QuantizedWeight | None:
        from kernels import quant

        kinds = _FROM_GGUF.get((self.fmt.bits, self.fmt.group_size), ())
        found = [self.blocks.get(n) for n in names]
        if not kinds or any(b is None or b.kind not in kinds for b in found):
            return None
        return quant.concat([quant.from_gguf_blocks(b.kind, b.rows, b.in_features)
                             for b in found])


# ---- bytes, for the memory estimate before loading (engine/memory.py) ----
def linear_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused matmuls: Q/K/V, O, gate/up, down."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def matrix_bytes(out: int, inp: int, bits: int, group_size: int | None, packed: bool) -> int:
    """Bytes of one quantized [out, inp] matrix as kernels/quant.py holds it: the packed CPU
    forms keep scales (and int4 zeros) in bfloat16, the dequantize form in float32."""
    group = group_size or inp
    groups = -(-inp // group)
    codes = out * groups * group * bits // 8
    if bits == 8:
        per_channel_packed = packed and group == inp
        return codes + out * groups * (2 if per_channel_packed else 4)
    return codes + out * groups * 2 * (2 if packed else 4)


def quantized_weight_bytes(config, parameters: int, float_size: int, fmt: WeightFormat,
                           packed: bool) -> int:
    """Weight bytes under a quantized format: embedding and norms float, layer matmuls in
    `fmt`, the LM head int8 per channel (a separate matrix even when tied)."""
    shapes = linear_shapes(config)
    linear_params = config.num_layers * sum(o * i for o, i in shapes)
    head_params = config.vocab_size * config.hidden_size
    float_params = parameters - linear_params - (0 if config.tie_word_embeddings else head_params)
    layers = config.num_layers * sum(matrix_bytes(o, i, fmt.bits, fmt.group_size, packed)
                                     for o, i in shapes)
    head = matrix_bytes(config.vocab_size, config.hidden_size, 8, None, packed)
    return float_params * float_size + layers + head
