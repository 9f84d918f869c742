"""What the CPU runs natively, read without torch (the app and the CLI size an engine before
torch is imported)."""

from __future__ import annotations

import functools
from pathlib import Path

# Instructions that compute in bfloat16 (oneDNN's native bfloat16 paths): AVX512-BF16 (Intel
# Cooper Lake and later, AMD Zen 4 and later) and AMX.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bfloat16 instructions (Linux; elsewhere unknown, so False).

    oneDNN also runs bfloat16 on plain AVX512 by emulation; that is slower per FLOP than
    float32, so only the instructions count here."""
    try:
        with cpuinfo.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if line.startswith("flags"):
                    return not BF16_FLAGS.isdisjoint(line.split(":", 1)[-1].split())
    except OSError:
        return False
    return False  # no flags line (another format: an emulator, another OS's procfs)


def cpu_default_dtype() -> str:
    """What dtype "auto" means on the CPU: bfloat16 where the CPU has bfloat16 instructions, as
    vLLM's CPU build defaults to (the demo model's perplexity over Alice ch. I: 18.436 in
    bfloat16 against 18.429 in float32, at half the bytes per token), else float32."""
    return "bfloat16" if native_bf16() else "float32"
