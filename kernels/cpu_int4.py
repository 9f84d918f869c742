"""Int4 weights times bfloat16 activations on CPUs with AVX512-BF16 (cpu_kernels.c's int4_linear).

PyTorch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`, kernels/quant.PackedInt4) decodes
every weight for every row block and is 2-3x slower than oneDNN's bfloat16 matmul from 16 rows
up, so a batch of decodes gained nothing from int4 weights. The C kernel decodes each tile of 16
outputs into bfloat16 registers once and multiplies it into up to 16 rows with VDPBF16PS; for
prefill-sized batches it decodes the whole weight into bfloat16 and leaves the matmul to oneDNN,
which is faster there. Weights keep the int4 footprint (codes plus float16 scales and mins: the
20 bytes per 32 weights of a GGUF Q4_1 block).

Used where the C kernels build, the CPU has AVX512-BF16 and the self-check agrees with the
dequantizing reference; elsewhere int4 weights keep PackedInt4 (or the reference).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.quant import QuantizedWeight, quantize_int4

log = logging.getLogger(__name__)

# From this many rows (a prefill chunk) decoding the weight once into bfloat16 and running
# oneDNN's matmul beats the tile kernel (benchmarks/cpu_kernels.py measures both).
DEQUANTIZE_ROWS = 192
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels._library()
    if lib is None:
        return None
    lib.int4_linear.argtypes = [_PTR] * 5 + [_I64] * 4 + [_INT, _INT]
    lib.int4_dequantize.argtypes = [_PTR] * 4 + [_I64] * 3 + [_INT]
    lib.int4_linear.restype = lib.int4_dequantize.restype = _INT
    return lib


def pack(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_linear's layout (cpu_kernels.c): codes [tiles, pairs, 16] bytes, where byte b of
    pair p of tile t holds output 16t + b/2 at input 2p + b%2 in its low nibble and output
    16t + 8 + b/2 in its high one; scales and mins float16 [tiles, groups, 16]."""
    tiles, pairs = q.out_features // 16, q.padded_in // 2
    codes = q.int_codes().to(torch.uint8).view(tiles, 2, 8, pairs, 2)
    codes = codes.permute(0, 3, 1, 2, 4).reshape(tiles, pairs, 2, 16)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).contiguous()
    groups = q.scales.shape[1]

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        return values.view(tiles, 16, groups).permute(0, 2, 1).to(torch.float16).contiguous()

    return packed, per_tile(q.scales), per_tile(q.mins)


def _takes(q: QuantizedWeight) -> bool:
    """Shapes and values the kernel handles: int4 in groups of 32 / 64 / 128, outputs a whole
    number of tiles, scales and mins that float16 holds (they are float16 in GGUF files)."""
    if q.bits != 4 or q.mins is None or q.out_features % 16 or q.group_size % 32:
        return False
    limits = torch.finfo(torch.float16).max
    return bool(q.scales.abs().max() < limits and q.mins.abs().max() < limits)


class Int4Linear:
    """An int4 weight in the kernel's layout; `linear` as QuantizedWeight.linear computes it, in
    bfloat16 products with float32 sums."""

    def __init__(self, q: QuantizedWeight) -> None:
        self.codes, self.scales, self.mins = pack(q)
        self.in_features, self.padded_in = q.in_features, q.padded_in
        self.out_features, self.group_size = q.out_features, q.group_size
        self.nbytes = self.codes.numel() + 2 * (self.scales.numel() + self.mins.numel())

    def dequantize(self) -> torch.Tensor:
        """The weight as bfloat16 [out, padded_in]."""
        w = torch.empty(self.out_features, self.padded_in, dtype=torch.bfloat16)
        _check(_library().int4_dequantize(
            self.codes.data_ptr(), self.scales.data_ptr(), self.mins.data_ptr(), w.data_ptr(),
            self.padded_in, self.out_features, self.group_size, torch.get_num_threads()))
        return w

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # ctypes is opaque to Dynamo: the op wraps the call
            y = torch.ops.servescope.int4_linear(x, self.codes, self.scales, self.mins,
                                                 self.group_size)
        else:
            y = self._linear(x)
        return y if bias is None else y + bias

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        x2 = x2.contiguous()
        rows = x2.shape[0]
        if rows >= DEQUANTIZE_ROWS:
            y = F.linear(x2, self.dequantize())
        else:
            out_bf16 = x.dtype == torch.bfloat16
            y = torch.empty(rows, self.out_features,
                            dtype=torch.bfloat16 if out_bf16 else torch.float32)
            _check(_library().int4_linear(
                x2.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr(),
                self.mins.data_ptr(), y.data_ptr(), rows, self.padded_in, self.out_features,
                self.group_size, int(out_bf16), torch.get_num_threads()))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _check(status: int) -> None:
    if status != 0:  # only a build without AVX512-BF16, which available() has refused
        raise RuntimeError("the CPU int4 kernel does not run on this CPU")


@torch.library.custom_op("servescope::int4_linear", mutates_args=())
def _int4_linear_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor, group_size: int) -> torch.Tensor:
    weight = Int4Linear.__new__(Int4Linear)
    weight.codes, weight.scales, weight.mins, weight.group_size = codes, scales, mins, group_size
    weight.out_features, weight.padded_in = codes.shape[0] * 16, codes.shape[1] * 2
    weight.in_features = x.shape[-1]
    return weight._linear(x)


@_int4_linear_op.register_fake
def _int4_linear_fake(x, codes, scales, mins, group_size):
    return x.new_empty((*x.shape[:-1], codes.shape[0] * 16))


def prepare(q: QuantizedWeight) -> Int4Linear | None:
    """The kernel's form of a CPU int4 weight, or None where it does not apply."""
    if q.codes.device.type != "cpu" or not _takes(q) or not available():
        return None
    return Int4Linear(q)


@functools.cache
def available() -> bool:
    """Whether int4_linear runs here (AVX512-BF16) and agrees with the dequantizing reference,
    on both paths (tiles of rows and the decoded weight), a partial row block, float32 and
    bfloat16 activations and a group of 64."""
    lib = _library()
    if lib is None or not cpu_kernels.available():
        return False
    gen = torch.Generator().manual_seed(0)
    for rows, group, dtype in ((3, 32, torch.bfloat16), (21, 64, torch.float32),
                               (DEQUANTIZE_ROWS, 32, torch.bfloat16)):
        q = quantize_int4(torch.randn(48, 128, generator=gen), group)
        x = torch.randn(rows, 128, generator=gen).to(dtype)
        weight = Int4Linear(q)
        try:
            decoded = weight.dequantize()
            got = weight.linear(x).float()
        except RuntimeError:
            return _disagrees("build")
        if decoded.float().sub(q.dequantize()).abs().max() > 2e-2:
            return _disagrees("decoded weight")
        want = q.linear(x.float())
        # bfloat16 weights and activations: ~3 significant digits of the output's scale.
        if (got - want).abs().max() > 2e-2 * want.abs().max():
            return _disagrees(f"{rows}-row product")
    return True


def _disagrees(what: str) -> bool:
    log.info("The CPU int4 kernel's %s disagrees with the reference (or the CPU lacks "
             "AVX512-BF16): int4 weights use PyTorch's packed op.", what)
    return False
