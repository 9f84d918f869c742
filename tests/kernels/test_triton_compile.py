"""The Triton kernels compile for real NVIDIA targets, checked without a GPU.

compile_kernels.py runs Triton's compiler and its bundled ptxas on every kernel variant the
wrappers launch; it runs in its own process because triton must be imported without
TRITON_INTERPRET for that, while test_triton.py imports it interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the dev extra has it on Linux "
                                     "x86_64)")

SCRIPT = Path(__file__).with_name("compile_kernels.py")


@pytest.mark.parametrize("arch,dtype,kernels", [
    # Hopper, the engine's default CUDA dtype: tl.dot through wgmma; int8 and fp8 KV caches
    ("90", "bf16", 16),
    # a consumer GPU's shared-memory limit against the largest tiles; int8 KV (no fp8 there)
    ("86", "fp32", 13),
])
def test_every_kernel_compiles_for_the_gpu(arch, dtype, kernels, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile afresh, not from an earlier run's cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, set to silence its warning
    done = subprocess.run([sys.executable, str(SCRIPT), arch, "--dtypes", dtype], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == kernels, done.stdout
    assert all(line.startswith(f"sm_{arch} {dtype} _") for line in lines)
