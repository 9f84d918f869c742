"""Decode attention on the CPU read straight from the paged cache: a small C kernel
(cpu_attention.c), built with the machine's C compiler on first use and called through ctypes.

The torch path (reference._decode_attention) gathers every decode sequence's keys and values into
a padded copy and calls scaled_dot_product_attention: at the demo model's decode shapes that is
dispatch and copying around a few MFLOP per layer. vLLM's CPU build has a C++ paged attention
kernel for the same reason. The kernel is the default for float32 and bfloat16 caches on the CPU
when it builds and passes its self-check against the torch path; otherwise (no compiler, a
quantized cache, another dtype) the torch path runs, so nothing depends on it being there.

The shared object is cached per source, compiler flags and CPU (it is built with
-march=native) under the user's cache directory; SERVESCOPE_CPU_ATTENTION=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from platformdirs import user_cache_dir

from kernels import reference
from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
# Vectorised reductions need reassociation; the kernel never relies on signed zeros, traps or
# errno, and keeps infinities (the softmax's running maximum starts at -inf).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-ffp-contract=fast", "-shared", "-fPIC", "-fopenmp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_DIM = 512  # cpu_attention.c's MAX_CHUNKS x 16
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and instruction flags."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as lines:
            parts += [line for line in lines if line.startswith(("model name", "flags"))][:2]
    except OSError:
        parts.append(platform.processor())
    return "".join(parts)


def _library_path(compiler: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                 _cpu_key().encode()):
        digest.update(part)
    cache = os.environ.get("SERVESCOPE_KERNEL_CACHE") or Path(user_cache_dir("servescope"),
                                                                "kernels")
    return Path(cache) / f"cpu_attention-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file and rename it into place, so that processes building at
    once (test workers, a server and the app) never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SERVESCOPE_CPU_ATTENTION", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.info("No C compiler found: decode attention on the CPU uses the torch path.")
        return None
    path = _library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as exc:
        log.warning("The CPU attention kernel did not build (%s: %s): using the torch path.",
                    compiler, exc.stderr.decode(errors="replace").strip()[-500:])
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("The CPU attention kernel did not load (%s): using the torch path.", exc)
        return None
    fn = lib.decode_attention
    fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                   ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def _lengths(meta: AttentionMetadata) -> torch.Tensor:
    """Each decode row's key count (rows are padded at the end, so the mask is a prefix)."""
    if meta.decode_lengths is not None:
        return meta.decode_lengths
    batch, width = meta.decode_slots.shape
    if meta.decode_mask is None:
        return torch.full((batch,), width, dtype=torch.int64)
    return meta.decode_mask.reshape(batch, width).sum(dim=1, dtype=torch.int64)


def _runs(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> bool:
    """Whether the kernel takes this step's decode rows (else the torch path does)."""
    return (meta.decode_slots is not None and q.dtype in DTYPES
            and isinstance(k_cache, torch.Tensor) and k_cache.dtype == q.dtype
            and v_cache.dtype == q.dtype and k_cache.device.type == "cpu"
            and q.shape[-1] % 16 == 0 and q.shape[-1] <= MAX_DIM
            and k_cache.is_contiguous() and v_cache.is_contiguous() and available())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of decode queries ([B, H, D], in decode_token_index order) over their keys."""
    q = q.contiguous()
    slots, lengths = meta.decode_slots, _lengths(meta)
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    status = _library().decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), slots.data_ptr(),
        lengths.data_ptr(), q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2],
        slots.shape[1], scale, DTYPES[q.dtype], torch.get_num_threads())
    if status != 0:  # out of memory in the kernel: the torch path says so its own way
        return reference._decode_attention(q, k_cache, v_cache, meta, scale)
    return out


def paged_attention(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """reference.paged_attention with its decode rows through the kernel where it runs them."""
    if not _runs(q, k_cache, v_cache, meta):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)
    rows = meta.decode_token_index
    if not meta.prefills and rows.shape[0] == q.shape[0]:
        return decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    out[rows] = decode_attention(q[rows], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = reference._prefill_attention(
            q[chunk.start : chunk.end], k_cache, v_cache, chunk, scale)
    return out


@functools.cache
def available() -> bool:
    """Whether the kernel builds here and agrees with the torch path on ragged GQA batches in
    both dtypes, on a specialised head dim and the general path (a wrong build must not serve)."""
    if _library() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, group, slots = 3, 2, 3, 40
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 48)):
        k = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
        q = torch.randn(batch, kv_heads * group, dim, generator=gen).to(dtype)
        lengths = torch.tensor([7, 12, 1])
        table = torch.randperm(slots, generator=gen)[: batch * 12].view(batch, 12)
        mask = (torch.arange(12)[None] < lengths[:, None])[:, None, None, :]
        meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.int64),
                                 decode_token_index=torch.arange(batch), decode_slots=table,
                                 decode_mask=mask)
        got = decode_attention(q, k, v, meta, dim ** -0.5).float()
        want = reference._decode_attention(q, k, v, meta, dim ** -0.5).float()
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(got, want, atol=tolerance, rtol=tolerance):
            log.warning("The CPU attention kernel disagrees with the torch path (%s, head dim "
                        "%d): not used.", dtype, dim)
            return False
    return True
