"""Int4 and int8 weights times bfloat16 activations on CPUs with AVX512-BF16 or AVX2
(cpu_kernels.c's int4_linear and int8_linear).

PyTorch's CPU quantized matmuls decode every weight for every block of rows: its int4 op
(`_weight_int4pack_mm_for_cpu`, kernels/quant.PackedInt4) is 2-3x slower than oneDNN's bfloat16
matmul from 16 rows up, and its int8 op (`_weight_int8pack_mm`) ran the demo model's LM head
(int8 under every quantized format) 3.5x slower than bfloat16 at 16 rows, so a batch of decodes
ran slower with quantized weights than with bfloat16 ones. The int4 kernel feeds the codes to
VDPBF16PS as bfloat16 numbers (128 + code: an integer OR) and applies each group's scale and min
to the group's sums, so decoding costs two integer ops per 32 codes (cpu_kernels.c says how); for
prefill-sized batches it decodes the whole weight into bfloat16 tiles and leaves the matmul to
the bfloat16 tile loop (kernels/cpu_linear.py), which is faster there; on CPUs where the AMX
kernel runs (kernels/cpu_linear.amx_runs), from AMX_MATMUL_ROWS rows each pair of weight tiles
is decoded into cache and multiplied on AMX's tile units (int4_amx_linear), as the int4 loop
does not use them. The int8 kernel converts each code to bfloat16 once per block of 16 rows and
applies the channel's scale to the sum; with AMX, from INT8_AMX_ROWS rows, it decodes tile
pairs into cache for the tile units likewise (int8_amx_linear).
Weights keep their footprint: int4 codes plus float16 scales and mins (the 20 bytes per 32
weights of a GGUF Q4_1 block), int8 codes plus bfloat16 scales, as PyTorch's ops hold them.

On CPUs with AVX2, FMA and F16C but no AVX512-BF16 the same functions are built on the same
layouts: int8 codes are decoded to float32 and the products of the bfloat16 activations sum in
float32 FMAs; int4 codes multiply the activations quantized to 16-bit integers per block of 32
inputs (VPMADDWD: exact integer sums, then each block's scale, min and activation scale in
float32; the quantization's error is at most a 65534th of the block's largest activation, 128x
below that activation's own bfloat16 rounding). Decoding each int4 code to float32 instead cost
more than its smaller stream saved: int4 ran slower than bfloat16 there.

Used where the C kernels build, the CPU has AVX512-BF16 or AVX2 and the self-check agrees with
the dequantizing reference; elsewhere the weights keep PyTorch's packed ops (or the reference).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.cpu_linear import (
    amx_runs,
    bf16_forward,
    check,
    through_kernel,
    tile_layout,
    untile,
)
from kernels.quant import QuantizedWeight, quantize_int4, quantize_int8

log = logging.getLogger(__name__)

# From this many rows (a prefill chunk) decoding the weight once into bfloat16 tiles and running
# the bfloat16 tile loop beats the int4 one (the demo model's layer shapes on a Zen 4 EPYC: even
# at 64 rows, 1.07-1.09x faster at 128, 1.11-1.35x at 256).
DEQUANTIZE_ROWS = 128
# Where the AMX kernel runs, from this many rows of bfloat16 activations int4 weights go to
# int4_amx_linear (each pair of weight tiles decoded into cache, then AMX's tile units) rather
# than the int4 tile loop: the demo model's linears on a 2-core Xeon with AMX, one call each,
# at 4 rows 0.87-0.97x the loop's speed, at 8 rows 1.12-1.50x, at 16 rows 2.2-2.6x
# (benchmarks/cpu_int4.py --linears-only, 2026-12-05).
# Before that kernel, the weight was decoded whole to memory for bf16_amx_linear from 16 rows.
AMX_MATMUL_ROWS = 8
# Where the AMX kernel runs, from this many rows of bfloat16 activations int8 weights go to
# int8_amx_linear: the demo model's LM head (49152 x 576, int8 under every quantized format)
# ran 1.06-1.19x the int8 loop's speed at 2 rows, 3.7-4.0x at 16, 6.8-7.1x at 64
# (benchmarks/cpu_int4.py); at 1 row 0.82x in one run, 1.16x in another, so 1 row keeps the loop.
INT8_AMX_ROWS = 2
_library = cpu_kernels._library  # one shared object; its C signatures are declared there


def pack(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_linear's layout (cpu_kernels.c): codes [tiles, pairs / 2, 32] bytes, where byte e of
    double pair d holds element e of pair 2d in its low nibble and of pair 2d + 1 in its high
    one, element e of pair p being output 16t + e/2 at input 2p + e%2; scales and mins float16
    [tiles, groups, 16]."""
    tiles, pairs = q.out_features // 16, q.padded_in // 2
    codes = q.int_codes().to(torch.uint8).view(tiles, 16, pairs // 2, 2, 2)  # t, n, d, pair, k
    codes = codes.permute(0, 2, 3, 1, 4).reshape(tiles, pairs // 2, 2, 32)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).contiguous()
    groups = q.scales.shape[1]

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        return values.view(tiles, 16, groups).permute(0, 2, 1).to(torch.float16).contiguous()

    return packed, per_tile(q.scales), per_tile(q.mins)


def _takes(q: QuantizedWeight) -> bool:
    """Shapes and values the kernels handle: outputs a whole number of tiles of 16; int4 in
    groups of 32 / 64 / 128 with scales and mins that float16 holds (they are float16 in GGUF
    files); int8 per output channel (the format PyTorch's op takes too)."""
    if q.out_features % 16:
        return False
    if q.bits == 8:
        return q.group_size == q.in_features and q.mins is None
    if q.bits != 4 or q.mins is None or q.group_size % 32:
        return False
    limits = torch.finfo(torch.float16).max
    return bool(q.scales.abs().max() < limits and q.mins.abs().max() < limits)


def _int4_decoded(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """An int4 weight in pack's layout as bfloat16 in the tile layout (cpu_linear.tile_layout)."""
    out, padded_in = codes.shape[0] * 16, codes.shape[1] * 4
    w = torch.empty(out // 16, padded_in // 2, 32, dtype=torch.bfloat16)
    check(_library().int4_dequantize(codes.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                                      w.data_ptr(), padded_in, out, group_size,
                                      torch.get_num_threads()))
    return w


# int4_path's answers, cpu_kernels.c's INT4_TILES / INT4_WHOLE / INT4_AMX.
INT4_TILES, INT4_WHOLE, INT4_AMX = 0, 1, 2


def on_amx(rows: int, matmul_rows: int, bf16: bool) -> bool:
    """Whether a quantized linear over `rows` rows runs on AMX (int4_amx_linear /
    int8_amx_linear: each pair of weight tiles decoded into cache) rather than a tile loop: from
    the weight's `matmul_rows` rows of bfloat16 activations (0: AMX does not run here, or, for
    int8, the inputs are not whole A tiles)."""
    return bool(matmul_rows and rows >= matmul_rows and bf16)


def int4_path(rows: int, matmul_rows: int, bf16: bool) -> int:
    """How an int4 linear over `rows` rows is multiplied: by int4_amx_linear where on_amx says
    so; else decoded whole into bfloat16 tiles for the bfloat16 tile loop from DEQUANTIZE_ROWS
    rows; else the int4 tile loop."""
    if on_amx(rows, matmul_rows, bf16):
        return INT4_AMX
    return INT4_WHOLE if rows >= DEQUANTIZE_ROWS else INT4_TILES


def _int4_forward(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  mins: torch.Tensor, group_size: int, matmul_rows: int = 0) -> torch.Tensor:
    """x @ W^T for an int4 weight in pack's layout, by the kernel int4_path picks."""
    out, padded_in = codes.shape[0] * 16, codes.shape[1] * 4
    rows = x.numel() // max(x.shape[-1], 1)
    path = int4_path(rows, matmul_rows, x.dtype == torch.bfloat16)
    if path == INT4_WHOLE:
        return bf16_forward(x, _int4_decoded(codes, scales, mins, group_size), None)
    kernel = "int4_amx_linear" if path == INT4_AMX else "int4_linear"
    return through_kernel(x, padded_in, out, lambda x2, y, y_bf16: getattr(_library(), kernel)(
        x2.data_ptr(), codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), y.data_ptr(),
        x2.shape[0], padded_in, out, group_size, y_bf16, torch.get_num_threads()))


def _int8_forward(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  matmul_rows: int = 0) -> torch.Tensor:
    """x @ W^T for a per-channel int8 weight in Int8Linear's layout."""
    out, padded_in = codes.shape[0] * 16, codes.shape[1] * 2
    rows = x.numel() // max(x.shape[-1], 1)
    kernel = ("int8_amx_linear" if on_amx(rows, matmul_rows, x.dtype == torch.bfloat16)
              else "int8_linear")
    return through_kernel(x, padded_in, out, lambda x2, y, y_bf16: getattr(_library(), kernel)(
        x2.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), x2.shape[0],
        padded_in, out, y_bf16, torch.get_num_threads()))


# ctypes is opaque to Dynamo: inside compiled code the calls go through these custom ops.
@torch.library.custom_op("servescope::int4_linear", mutates_args=())
def _int4_linear_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor, group_size: int, matmul_rows: int) -> torch.Tensor:
    return _int4_forward(x, codes, scales, mins, group_size, matmul_rows)


@_int4_linear_op.register_fake
def _int4_linear_fake(x, codes, scales, mins, group_size, matmul_rows):
    return x.new_empty((*x.shape[:-1], codes.shape[0] * 16))


@torch.library.custom_op("servescope::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    matmul_rows: int) -> torch.Tensor:
    return _int8_forward(x, codes, scales, matmul_rows)


@_int8_linear_op.register_fake
def _int8_linear_fake(x, codes, scales, matmul_rows):
    return x.new_empty((*x.shape[:-1], codes.shape[0] * 16))


class Int4Linear:
    """An int4 weight in the kernel's layout; `linear` as QuantizedWeight.linear computes it, in
    bfloat16 products with float32 sums."""

    def __init__(self, q: QuantizedWeight) -> None:
        self.codes, self.scales, self.mins = pack(q)
        self.in_features, self.padded_in = q.in_features, q.padded_in
        self.out_features, self.group_size = q.out_features, q.group_size
        self.nbytes = self.codes.numel() + 2 * (self.scales.numel() + self.mins.numel())
        # From how many rows the decoded weight goes to the AMX kernel (0: it does not run here).
        self.matmul_rows = AMX_MATMUL_ROWS if amx_runs() else 0

    def dequantize(self) -> torch.Tensor:
        """The weight as bfloat16 [out, padded_in]."""
        return untile(_int4_decoded(self.codes, self.scales, self.mins, self.group_size))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        forward = (torch.ops.servescope.int4_linear if torch.compiler.is_compiling()
                   else _int4_forward)
        y = forward(x, self.codes, self.scales, self.mins, self.group_size, self.matmul_rows)
        return y if bias is None else y + bias


class Int8Linear:
    """A per-channel int8 weight in int8_linear's layout: codes [tiles, pairs, 32], element e of
    pair p being output 16t + e/2 at input 2p + e%2; scales bfloat16 [out]."""

    def __init__(self, q: QuantizedWeight) -> None:
        codes = q.codes
        if q.in_features % 2:
            codes = F.pad(codes, (0, 1))
        self.in_features, self.padded_in = q.in_features, codes.shape[1]
        self.out_features = q.out_features
        self.codes = tile_layout(codes)
        self.scales = q.scales[:, 0].to(torch.bfloat16).contiguous()
        self.nbytes = self.codes.numel() + 2 * self.scales.numel()
        # From how many rows int8_amx_linear runs (0: AMX does not run here, or the inputs are
        # not whole A tiles of 32).
        self.matmul_rows = INT8_AMX_ROWS if amx_runs() and self.padded_in % 32 == 0 else 0

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        forward = (torch.ops.servescope.int8_linear if torch.compiler.is_compiling()
                   else _int8_forward)
        y = forward(x, self.codes, self.scales, self.matmul_rows)
        return y if bias is None else y + bias


def prepare(q: QuantizedWeight) -> Int4Linear | Int8Linear | None:
    """The kernels' form of a CPU int4 / int8 weight, or None where they do not apply."""
    if q.codes.device.type != "cpu" or not _takes(q) or not available():
        return None
    return Int4Linear(q) if q.bits == 4 else Int8Linear(q)


@functools.cache
def available() -> bool:
    """Whether the kernels run here (AVX512-BF16, or AVX2 with FMA and F16C) and agree with the
    dequantizing reference: int4 on each path int4_path takes here (tiles of rows, the weight
    decoded whole, and int4_amx_linear where AMX runs, with a partial row block), float32 and
    bfloat16 activations and a group of 64; int8 on a partial and a whole row block, with an odd
    input count, and on int8_amx_linear where AMX runs."""
    lib = _library()
    if lib is None or not cpu_kernels.available():
        return False
    gen = torch.Generator().manual_seed(0)
    cases = [(quantize_int4(torch.randn(48, 128, generator=gen), group), rows, dtype)
             for rows, group, dtype in ((3, 32, torch.bfloat16), (21, 64, torch.float32),
                                        (DEQUANTIZE_ROWS, 32, torch.bfloat16),
                                        (DEQUANTIZE_ROWS, 64, torch.float32),
                                        (AMX_MATMUL_ROWS + 5, 64, torch.bfloat16))]
    cases += [(quantize_int8(torch.randn(32, in_features, generator=gen)), rows, dtype)
              for rows, in_features, dtype in ((5, 95, torch.bfloat16), (16, 95, torch.float32),
                                               (INT8_AMX_ROWS + 17, 64, torch.bfloat16))]
    for q, rows, dtype in cases:
        x = torch.randn(rows, q.in_features, generator=gen).to(dtype)
        weight = Int4Linear(q) if q.bits == 4 else Int8Linear(q)
        try:
            got = weight.linear(x).float()
            decoded = weight.dequantize() if q.bits == 4 else None
        except RuntimeError:
            return _disagrees("build")
        if decoded is not None and decoded.float().sub(q.dequantize()).abs().max() > 2e-2:
            return _disagrees("decoded int4 weight")
        want = q.linear(x.float())
        # bfloat16 weights and activations: ~3 significant digits of the output's scale.
        if (got - want).abs().max() > 2e-2 * want.abs().max():
            return _disagrees(f"int{q.bits} {rows}-row product")
    return True


def _disagrees(what: str) -> bool:
    log.info("The CPU's quantized-weight kernel (%s) disagrees with the reference, or the CPU "
             "lacks AVX512-BF16 and AVX2: int4 / int8 weights use PyTorch's packed ops.", what)
    return False
