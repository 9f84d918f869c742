"""Bfloat16 weights through cpu_kernels.c's tile loop (bf16_linear) on CPUs with AVX512-BF16 or
AVX2, and the tile layout that loop shares with the int8 kernel (kernels/cpu_quant.py).

At decode sizes (1-16 rows) a matmul is one pass over the weight, and oneDNN's packed bfloat16
matmul (kernels/onednn.py) made that pass slowly on a Zen 4 EPYC: the demo model's 30 layers'
linears at batch 1 read their weights at 17 GB/s where the machine streams 28, and at 16 rows
multiplied at under half the VDPBF16PS peak. The tile loop (cpu_kernels.c says how) ran the
demo model's batch-1 decode step 1.3-1.7x faster, its 16-sequence step 1.07-1.10x and a
16-prompt prefill 1.03-1.07x (benchmarks/cpu_bf16.py, three runs: both alternating in one
process), so one layout serves every
step and the weight is held once, as oneDNN's packed copy was. Where the kernel does not
build, the CPU lacks AVX512-BF16 and AVX2, the self-check disagrees or a shape has outputs that
are not a whole number of tiles of 16, the weight keeps oneDNN's layout.

On x86 CPUs with AVX2, FMA and F16C but no AVX512-BF16 (Zen 2 / Zen 3 EPYCs, Intel before
Cooper Lake) the same function is built from AVX2 FMAs on the same layout: each bfloat16 weight
pair becomes two float32 vectors with a shift and a mask, products of bfloat16 values are exact in
float32, and the sums are float32 as VDPBF16PS's. oneDNN has no bfloat16 path on such CPUs, so
bfloat16 ran through F.linear there and float32 through oneDNN was the default; with this build
bfloat16 weights, and a decode step in one C call (kernels/cpu_layers.py), make bfloat16 the
faster default there (benchmarks/cpu_avx2.py has the figures).

On CPUs with AMX (Xeons from Sapphire Rapids on) the same layout is AMX's bfloat16 B-tile format,
and cpu_kernels.c's bf16_amx_linear multiplies straight from it on the AMX tile units (inputs
padded to whole A tiles of 32). oneDNN's bfloat16 matmul uses AMX too and beat the AVX512 loop
there (0.6x at 16 rows, 0.27x in prefill), but the AMX kernel beat oneDNN: a 2-core Xeon with AMX
ran the demo model's decode step 1.24-1.32x faster at 1-16 sequences and a 16-prompt prefill
1.10x (benchmarks/cpu_bf16.py). Where the CPU has AMX but the AMX kernel does not run (a compiler
without AMX, the kernel's self-check, Linux refusing the tile state), the weight keeps oneDNN's.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from kernels import cpu_kernels

log = logging.getLogger(__name__)

_library = cpu_kernels._library  # one shared object; its C signatures are declared there
AMX_INPUTS = 32  # inputs per AMX A tile (64 bytes of bfloat16): the AMX kernel's input multiple


def tile_layout(matrix: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight (in even) as [tiles, pairs, 32]: element e of pair p of tile t is
    output 16t + e/2 at input 2p + e%2, the order VDPBF16PS pairs them with a broadcast
    activation pair."""
    out, padded_in = matrix.shape
    return matrix.view(out // 16, 16, padded_in // 2, 2).permute(0, 2, 1, 3).reshape(
        out // 16, padded_in // 2, 32).contiguous()


def untile(tiles: torch.Tensor) -> torch.Tensor:
    """A weight in tile_layout back as [out, padded_in]."""
    count, pairs = tiles.shape[:2]
    return tiles.view(count, pairs, 16, 2).permute(0, 2, 1, 3).reshape(count * 16, pairs * 2)


def _bf16_rows(x: torch.Tensor, padded_in: int) -> torch.Tensor:
    """x as the kernels read it: contiguous bfloat16 rows, zero-padded to `padded_in`."""
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    if padded_in != in_features:
        x2 = F.pad(x2, (0, padded_in - in_features))
    return x2.contiguous()


def check(status: int) -> None:
    """Raise where a tile kernel refused: a build without AVX512-BF16 or AVX2 (which the
    self-checks have refused before any weight takes a kernel) or no memory for its copy of the
    rows."""
    if status != 0:
        raise RuntimeError("a CPU tile kernel failed: no AVX512-BF16 or AVX2 in this build, or "
                           "no memory for its copy of the rows")


def through_kernel(x: torch.Tensor, padded_in: int, out: int, call) -> torch.Tensor:
    """x @ W^T by a tile kernel (bfloat16, int8 or int4 weights): `call(rows, y, y_bf16)` runs
    it on x's rows as the kernels read them into y ([rows, out]: bfloat16 for bfloat16
    activations, float32 for any other; y_bf16 says which) and returns its status; the result
    comes back in x's dtype and leading shape."""
    x2 = _bf16_rows(x, padded_in)
    y = torch.empty(x2.shape[0], out,
                    dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
    check(call(x2, y, int(y.dtype == torch.bfloat16)))
    return y.to(x.dtype).view(*x.shape[:-1], out)


def bf16_forward(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias for a bfloat16 weight in tile_layout: on AMX's tile units where they run
    here and the inputs are whole A tiles (32), else the tile loop (AVX512-BF16 or AVX2)."""
    amx = tiles.shape[1] % (AMX_INPUTS // 2) == 0 and amx_runs()
    return _tiles_forward(x, tiles, bias, "bf16_amx_linear" if amx else "bf16_linear")


def _tiles_forward(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None,
                   kernel: str) -> torch.Tensor:
    out, padded_in = tiles.shape[0] * 16, tiles.shape[1] * 2
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    call = getattr(_library(), kernel)
    return through_kernel(x, padded_in, out, lambda x2, y, y_bf16: call(
        x2.data_ptr(), tiles.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), x2.shape[0], padded_in, out, y_bf16, torch.get_num_threads()))


# ctypes is opaque to Dynamo: inside compiled code the call goes through this custom op.
@torch.library.custom_op("servescope::bf16_linear", mutates_args=())
def _bf16_linear_op(x: torch.Tensor, tiles: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return bf16_forward(x, tiles, bias)


@_bf16_linear_op.register_fake
def _bf16_linear_fake(x, tiles, bias):
    return x.new_empty((*x.shape[:-1], tiles.shape[0] * 16))


class Bf16Linear:
    """A bfloat16 weight in tile_layout (inputs padded to an even count); `linear` computes
    x @ W^T + bias in bfloat16 products with float32 sums, as oneDNN does."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        # Inputs in pairs for the tile loop, in whole A tiles (32) for AMX's units.
        multiple = AMX_INPUTS if amx_runs() else 2
        padded = F.pad(weight, (0, -self.in_features % multiple))
        self.padded_in = padded.shape[1]
        self.tiles = tile_layout(padded.to(torch.bfloat16))
        self.nbytes = self.tiles.numel() * self.tiles.element_size()

    def dense(self) -> torch.Tensor:
        """The weight back as bfloat16 [out, in]."""
        return untile(self.tiles)[:, : self.in_features]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        forward = (torch.ops.servescope.bf16_linear if torch.compiler.is_compiling()
                   else bf16_forward)
        return forward(x, self.tiles, bias)


def takes(weight: torch.Tensor) -> bool:
    """Weights the kernel runs: bfloat16 on the CPU, outputs a whole number of tiles of 16."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0)


def prepare(weight: torch.Tensor) -> Bf16Linear | None:
    """The kernel's form of a bfloat16 CPU weight, or None where it does not apply or oneDNN is
    the better choice (AMX)."""
    if not takes(weight) or not preferred():
        return None
    return Bf16Linear(weight)


@functools.cache
def preferred() -> bool:
    """Whether bfloat16 weights should take the tile layout here: the tile loop runs, and where
    the CPU has AMX, the AMX kernel runs too (oneDNN's matmul, which uses AMX, beats the loop)."""
    if not available():
        return False
    if has_amx() and not amx_runs():
        log.info("This CPU has AMX but the AMX kernel does not run here: bfloat16 weights keep "
                 "oneDNN's matmul, which uses it.")
        return False
    return True


@functools.cache
def amx_runs() -> bool:
    """Whether bf16_amx_linear runs here: the CPU has AMX, the kernel was built with it, Linux
    grants this process AMX's tile state, and it agrees with F.linear on the same bfloat16 values
    (one row, a partial and a whole row block, an odd number of output tiles, with and without a
    bias, bfloat16 and float32 activations)."""
    lib = _library()
    if lib is None or not has_amx() or lib.amx_enable() != 0:
        return False
    return _agrees("bf16_amx_linear", ((1, 64, False, torch.bfloat16),
                                        (17, 96, True, torch.float32),
                                        (40, 128, True, torch.bfloat16)))


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX's bfloat16 tile units (Xeons from Sapphire Rapids on)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            return any(line.startswith("flags") and " amx_bf16" in line for line in info)
    except OSError:
        return False


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (AVX512-BF16, or AVX2 with FMA and F16C) and agrees with
    F.linear on the same bfloat16 values: one row, a partial and a whole row block and more than
    one block, with and without a bias, an odd input count, bfloat16 and float32 activations."""
    lib = _library()
    if lib is None or not cpu_kernels.available():
        return False
    return _agrees("bf16_linear", ((1, 96, False, torch.bfloat16), (7, 95, True, torch.bfloat16),
                                   (16, 64, True, torch.float32), (37, 64, False, torch.bfloat16)))


def _agrees(kernel: str, cases) -> bool:
    """Whether a tile kernel computes F.linear on (rows, inputs, with a bias, activations' dtype)
    cases, 48 outputs (three tiles) each."""
    gen = torch.Generator().manual_seed(0)
    for rows, in_features, with_bias, dtype in cases:
        weight = torch.randn(48, in_features, generator=gen).to(torch.bfloat16)
        bias = torch.randn(48, generator=gen).to(torch.bfloat16) if with_bias else None
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        tiles = tile_layout(F.pad(weight, (0, in_features % 2)))
        try:
            got = _tiles_forward(F.pad(x, (0, in_features % 2)), tiles, bias, kernel).float()
        except RuntimeError:
            return _disagrees(kernel, "build")
        want = F.linear(x.to(torch.bfloat16).float(), weight.float(),
                        None if bias is None else bias.float())
        # Products of bfloat16 values summed in float32, rounded once to bfloat16 (2^-9).
        if got.shape != want.shape or (got - want).abs().max() > 2e-2 * want.abs().max():
            return _disagrees(kernel, f"{rows}-row product")
    return True


def _disagrees(kernel: str, what: str) -> bool:
    log.info("The CPU's bfloat16 kernel %s (%s) disagrees with F.linear, or the CPU lacks "
             "its instructions (AVX512-BF16, AMX): bfloat16 weights do not use it.", kernel, what)
    return False
