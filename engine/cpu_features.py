"""What the CPU runs natively, read without torch (the app and the CLI size an engine before
torch is imported)."""

from __future__ import annotations

import functools
from pathlib import Path

# Instructions that compute in bfloat16 (oneDNN's native bfloat16 paths): AVX512-BF16 (Intel
# Cooper Lake and later, AMD Zen 4 and later) and AMX.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# What the engine's C tile kernels need to multiply bfloat16 weights without those (float32 FMAs
# on AVX2 registers; kernels/cpu_linear.py): x86 CPUs since Haswell and Zen 1.
AVX2_TILE_FLAGS = frozenset({"avx2", "fma", "f16c"})


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's instruction flags (Linux; elsewhere, or with no flags line, none)."""
    try:
        with cpuinfo.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        return frozenset()
    return frozenset()  # no flags line (another format: an emulator, another OS's procfs)


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bfloat16 instructions.

    oneDNN also runs bfloat16 on plain AVX512 by emulation; that is slower per FLOP than
    float32, so only the instructions count here."""
    return not BF16_FLAGS.isdisjoint(cpu_flags(cpuinfo))


def avx2_tiles(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the C tile kernels' AVX2 build serves this CPU's bfloat16 weights (it has AVX2,
    FMA and F16C but no bfloat16 instructions)."""
    return not native_bf16(cpuinfo) and cpu_flags(cpuinfo) >= AVX2_TILE_FLAGS


def cpu_default_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """What dtype "auto" means on the CPU: bfloat16 where the CPU has bfloat16 instructions, as
    vLLM's CPU build defaults to (the demo model's perplexity over Alice ch. I: 18.436 in
    bfloat16 against 18.429 in float32, at half the bytes per token), and where it has AVX2 with
    FMA and F16C, whose C tile kernels multiply bfloat16 weights and activations in float32 (a
    2-core Zen 2 EPYC decoded 3.8x faster at batch 1 than float32 through oneDNN:
    benchmarks/cpu_avx2.py); else float32. The engine keeps float32 where the kernels do not
    build (engine/devices.resolve_dtype)."""
    return "bfloat16" if native_bf16(cpuinfo) or avx2_tiles(cpuinfo) else "float32"
