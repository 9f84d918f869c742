"""The engine's CPU kernels in C (cpu_kernels.c): decode attention read straight from the paged
cache, bfloat16 prefill attention (flash attention on VDPBF16PS), RMSNorm with its residual add,
rotary embedding and SwiGLU; built with the machine's C compiler on first use and called through
ctypes.

At decode sizes PyTorch's eager ops cost microseconds of dispatch each for little arithmetic: the
torch decode attention (reference._decode_attention) gathers every sequence's keys and values into
a padded copy before scaled_dot_product_attention, an RMSNorm is nine ops, rotary ten, SwiGLU
three. vLLM's CPU build has C++ kernels for the same reason. The kernels are the CPU table's ops
for float32 and bfloat16 when they build and pass their self-check against the reference;
otherwise (no compiler, a quantized cache, another dtype, a shape they do not take) the
reference runs, so nothing depends on them being there.

The shared object is cached per source, compiler flags and CPU (it is built with -march=native)
under the user's cache directory; SERVESCOPE_CPU_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from platformdirs import user_cache_dir

from kernels import reference
from kernels.metadata import AttentionMetadata, PrefillChunk

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Vectorised reductions need reassociation; the kernels never rely on signed zeros, traps or
# errno, and keep infinities (the softmax's running maximum starts at -inf).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-ffp-contract=fast", "-shared", "-fPIC", "-fopenmp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_DIM = 512  # cpu_kernels.c's MAX_DIM
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
    return Path(cache) / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


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


def _prune(built: Path, unused_days: float = 30) -> None:
    """Remove the cache's other builds not loaded for `unused_days` (each source edit, compiler
    or CPU change leaves one behind). A process holding one keeps it mapped; a later one that
    wants it back builds it again in under a second."""
    cutoff = time.time() - unused_days * 86400
    for old in built.parent.glob("cpu_kernels-*.so"):
        # OSError: another process pruned it first, or the directory is read-only.
        with contextlib.suppress(OSError):
            if old != built and old.stat().st_mtime < cutoff:
                old.unlink()


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SERVESCOPE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.info("No C compiler found: the CPU runs the torch reference ops.")
        return None
    path = _library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
            _prune(path)
        lib = ctypes.CDLL(str(path))
        os.utime(path)  # marks it used, for _prune
    except subprocess.CalledProcessError as exc:
        log.warning("The CPU kernels did not build (%s: %s): using the torch reference ops.",
                    compiler, exc.stderr.decode(errors="replace").strip()[-500:])
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("The CPU kernels did not load (%s): using the torch reference ops.", exc)
        return None
    _INT, _F32 = ctypes.c_int, ctypes.c_float
    signatures = {
        "decode_attention": [_PTR] * 6 + [_I64] * 5 + [_F32, _INT, _INT],
        # bfloat16 prefill chunks: -1 without AVX512-BF16.
        "prefill_attention": [_PTR] * 6 + [_I64] * 5 + [_F32, _INT],
        "rms_norm": [_PTR] * 5 + [_I64, _I64, _F32, _INT, _INT],
        "rotary": [_PTR] * 6 + [_I64] * 6 + [_INT, _INT],
        "silu_and_mul": [_PTR, _PTR, _I64, _I64, _INT, _INT],
        "softmax_topk": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR],
        # The weights' tile kernels (kernels/cpu_quant.py): -1 without AVX512-BF16 or AVX2.
        "int4_linear": [_PTR] * 5 + [_I64] * 4 + [_INT, _INT],
        "int4_dequantize": [_PTR] * 4 + [_I64] * 3 + [_INT],
        "int4_amx_linear": [_PTR] * 5 + [_I64] * 4 + [_INT, _INT],
        "int8_amx_linear": [_PTR] * 4 + [_I64] * 3 + [_INT, _INT],
        "int8_linear": [_PTR] * 4 + [_I64] * 3 + [_INT, _INT],
        # bfloat16 weights (kernels/cpu_linear.py): -1 without AVX512-BF16 or AVX2.
        "bf16_linear": [_PTR] * 4 + [_I64] * 3 + [_INT, _INT],
        # The same on AMX's tile units (kernels/cpu_linear.py): -1 without AMX.
        "bf16_amx_linear": [_PTR] * 4 + [_I64] * 3 + [_INT, _INT],
        "amx_enable": [],
        # A decode step's layers (kernels/cpu_layers.py): -1 without AVX512-BF16 or AVX2.
        "decode_layers": ([_PTR, _I64] + [_PTR] * 7 + [_I64] * 8 + [_PTR, _I64, _PTR, _PTR]
                          + [_F32, _F32] + [_INT] * 4),
        # A hidden-state draft's level (kernels/cpu_draft.py): -1 without AVX512-BF16 or AVX2.
        "draft_level": [_PTR] * 3 + [_I64] * 6 + [_F32, _I64] + [_PTR] * 3 + [_INT],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
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
    slots, lengths = int64_contiguous(meta.decode_slots), _lengths(meta)
    out = torch.empty_like(q)
    status = _library().decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), slots.data_ptr(),
        lengths.data_ptr(), q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2],
        slots.shape[1], scale, DTYPES[q.dtype], torch.get_num_threads())
    if status != 0:  # out of memory in the kernel: the torch path says so its own way
        return reference._decode_attention(q, k_cache, v_cache, meta, scale)
    return out


def int64_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read an index tensor: contiguous int64 (a copy only where it is not)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def prefill_attention(q: torch.Tensor, k_cache, v_cache, chunk: PrefillChunk,
                      scale: float) -> torch.Tensor:
    """Attention of one prefill chunk's queries ([n, H, D]) over its keys: the kernel for
    bfloat16 (with AVX512-BF16, a head dim that is a multiple of 32), else the torch path."""
    out = (_prefill_kernel(q, k_cache, v_cache, chunk, scale)
           if _prefill_runs(q, k_cache, v_cache) and prefill_available() else None)
    return reference._prefill_attention(q, k_cache, v_cache, chunk, scale) if out is None else out


PREFILL_MAX_DIM = 256  # cpu_kernels.c's PF_MAX_DIM
PREFILL_REPACK_BYTES = 256 << 20  # cpu_kernels.c's PF_REPACK_BYTES


def _prefill_runs(q: torch.Tensor, k_cache, v_cache) -> bool:
    return (q.dtype == torch.bfloat16 and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and k_cache.dtype == torch.bfloat16
            and v_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu"
            and prefill_takes(q.shape[-1]) and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def prefill_takes(head_dim: int) -> bool:
    """Whether the prefill kernel takes this head dim (a multiple of 32 up to 256)."""
    return head_dim % 32 == 0 and head_dim <= PREFILL_MAX_DIM


def prefill_chunk_fits(chunk: PrefillChunk, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this chunk: its repacked keys and values within the kernel's
    limit, and a mask (where it must read one) of bools, one per query and key."""
    ctx, n = chunk.slots.shape[0], chunk.end - chunk.start
    repacked = kv_heads * -(-ctx // 16) * 16 * head_dim * 4  # keys and values, 2 bytes each
    if repacked > PREFILL_REPACK_BYTES:
        return False
    if chunk.mask is None:  # a fresh prompt: causal over exactly its own keys
        return ctx == n
    mask = chunk.mask
    return chunk.causal or (mask.dtype == torch.bool and tuple(mask.shape) == (n, ctx))


def prefill_mask(chunk: PrefillChunk) -> torch.Tensor | None:
    """The mask the kernel must read for this chunk, contiguous; None where it applies the
    causal mask from the chunk's position itself."""
    return None if chunk.mask is None or chunk.causal else chunk.mask.contiguous()


def _prefill_kernel(q, k_cache, v_cache, chunk: PrefillChunk, scale: float):
    """The kernel's output, or None where it declines (a shape it does not take, a context
    too long for its repacked copy, no AVX512-BF16, a failed allocation)."""
    if not prefill_chunk_fits(chunk, k_cache.shape[1], q.shape[-1]):
        return None
    q, slots, mask = q.contiguous(), int64_contiguous(chunk.slots), prefill_mask(chunk)
    out = torch.empty_like(q)
    status = _library().prefill_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), slots.data_ptr(),
        None if mask is None else mask.data_ptr(), q.shape[0], slots.shape[0], q.shape[1],
        k_cache.shape[1], q.shape[2], scale, torch.get_num_threads())
    return out if status == 0 else None


def paged_attention(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """reference.paged_attention with its decode rows and prefill chunks through the kernels
    where they run them."""
    decode = decode_attention if _runs(q, k_cache, v_cache, meta) else reference._decode_attention
    return reference.attend_rows(q, k_cache, v_cache, meta, scale, decode, prefill_attention)


def _kernel_dtype(*tensors: torch.Tensor) -> bool:
    """Whether the tensors are CPU tensors of one dtype the kernels take."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm in one call (with the residual add)."""
    width = weight.shape[-1]
    operands = (x, weight) if residual is None else (x, weight, residual)
    if (_kernel_dtype(*operands) and x.is_contiguous() and weight.is_contiguous()
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
            and x.shape[-1] == width and width % 16 == 0 and available()):
        out = _rms_norm(x, weight, eps, residual)
        if out is not None:
            return out
    return reference.rms_norm(x, weight, eps, residual)


def _rms_norm(x, weight, eps, residual):
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    status = _library().rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), summed.data_ptr(), x.numel() // weight.shape[-1], weight.shape[-1],
        eps, DTYPES[x.dtype], torch.get_num_threads())
    return (out, summed) if status == 0 else None


def _token_stride(x: torch.Tensor) -> int | None:
    """The stride between tokens of [n, heads, dim] whose heads are packed (a view into the
    fused QKV output qualifies); None for other layouts."""
    heads, dim = x.shape[1], x.shape[2]
    if x.stride(2) == 1 and (x.stride(1) == dim or heads == 1):
        return x.stride(0)
    return None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary in one call, into contiguous q and k."""
    dim = q.shape[-1]
    strides = (_token_stride(q), _token_stride(k))
    if (_kernel_dtype(q, k, cos, sin) and None not in strides and cos.is_contiguous()
            and sin.is_contiguous() and k.shape[-1] == dim
            and cos.shape == (q.shape[0], dim) == sin.shape and dim % 32 == 0 and available()):
        out = _rotary(q, k, cos, sin, strides)
        if out is not None:
            return out
    return reference.rotary(q, k, cos, sin)


def _rotary(q, k, cos, sin, strides: tuple[int, int]):
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    status = _library().rotary(
        q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
        k_out.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2], *strides,
        DTYPES[q.dtype], torch.get_num_threads())
    return (q_out, k_out) if status == 0 else None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul (gate and up concatenated on the last dimension) in one call."""
    if (_kernel_dtype(x) and x.is_contiguous() and x.shape[-1] % 32 == 0 and available()):
        out = _silu_and_mul(x)
        if out is not None:
            return out
    return reference.silu_and_mul(x)


def _silu_and_mul(x):
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype)
    status = _library().silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * width),
                                     width, DTYPES[x.dtype], torch.get_num_threads())
    return out if status == 0 else None


def softmax_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.softmax_topk in one pass over each row (float32 rows of unit stride), without
    the softmax's full-width output: a draft tree spent more in torch's softmax and topk over
    its 8,192 columns than in stepping the draft (77 us at 4 rows)."""
    if (scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() == 2
            and scores.stride(-1) == 1 and available()):
        got = _softmax_topk(scores, k)
        if got is not None:
            return got
    return reference.softmax_topk(scores, k)


def _softmax_topk(scores, k):
    rows, n = scores.shape
    probs = torch.empty(rows, k, dtype=torch.float32)
    cols = torch.empty(rows, k, dtype=torch.int64)
    status = _library().softmax_topk(scores.data_ptr(), rows, n, scores.stride(0), k,
                                     probs.data_ptr(), cols.data_ptr())
    # -1: k outside 1..64 or past the row, a NaN, or too few finite scores.
    return (probs, cols) if status == 0 else None


OPS = {"paged_attention": paged_attention, "rms_norm": rms_norm, "rotary": rotary,
       "silu_and_mul": silu_and_mul, "softmax_topk": softmax_topk}


def _agrees(got, want, dtype: torch.dtype) -> bool:
    if got is None:
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    return all(torch.allclose(g.float(), w.float(), atol=tolerance, rtol=tolerance)
               for g, w in zip(got, want, strict=True))


@functools.cache
def prefill_available() -> bool:
    """Whether the prefill attention kernel runs here (AVX512-BF16) and agrees with the torch
    path: GQA chunks over a cached prefix (causal from the chunk's position, past two key
    blocks) and a draft tree's mask, head dims 64, 128 and 96 (the unspecialised loop),
    bfloat16; no further from the exact result than torch's own bfloat16 attention, but for a
    rounding."""
    if _library() is None:
        return False
    gen = torch.Generator().manual_seed(1)
    for dim, kv_heads, group, n, ctx in ((64, 3, 3, 37, 600), (128, 2, 1, 20, 20),
                                         (96, 1, 2, 33, 70)):
        k = torch.randn(700, kv_heads, dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(700, kv_heads, dim, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, kv_heads * group, dim, generator=gen).to(torch.bfloat16)
        slots = torch.randperm(700, generator=gen)[:ctx]
        causal = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
        tree = causal.clone()
        tree[n - 3 :, ctx - 3 :] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        for mask, is_causal in ((causal, True), (tree, False)):
            chunk = PrefillChunk(0, n, slots, mask, causal=is_causal)
            got = _prefill_kernel(q, k, v, chunk, dim ** -0.5)
            if got is None:
                return False
            want = reference._prefill_attention(q.float(), k.float(), v.float(), chunk,
                                                dim ** -0.5)
            torch_bf16 = reference._prefill_attention(q, k, v, chunk, dim ** -0.5)
            allowed = 1.5 * (torch_bf16.float() - want).abs().max() + 2e-3
            if not (got.float() - want).abs().max() <= allowed:
                log.warning("The CPU prefill attention kernel disagrees with the reference "
                            "(head dim %d): the torch path runs instead.", dim)
                return False
    return True


@functools.cache
def available() -> bool:
    """Whether the kernels build here and agree with the reference: attention on ragged GQA
    batches on a specialised head dim and the general path, RMSNorm with and without the
    residual, rotary on a strided view, SwiGLU, in both dtypes (a wrong build must not
    serve)."""
    if _library() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, group, slots = 3, 2, 3, 40
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 48)):
        k, v = rand(slots, kv_heads, dim).to(dtype), rand(slots, kv_heads, dim).to(dtype)
        q = rand(batch, kv_heads * group, dim).to(dtype)
        lengths = torch.tensor([7, 12, 1])
        table = torch.randperm(slots, generator=gen)[: batch * 12].view(batch, 12)
        mask = (torch.arange(12)[None] < lengths[:, None])[:, None, None, :]
        meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.int64),
                                 decode_token_index=torch.arange(batch), decode_slots=table,
                                 decode_mask=mask)
        checks = {"decode attention": (
            [decode_attention(q, k, v, meta, dim ** -0.5)],
            [reference._decode_attention(q, k, v, meta, dim ** -0.5)])}
        x, residual, weight = (rand(5, 96).to(dtype), rand(5, 96).to(dtype),
                               rand(96).to(dtype))
        for res in (None, residual):
            checks[f"RMSNorm (residual: {res is not None})"] = (
                _rms_norm(x, weight, 1e-5, res), reference.rms_norm(x, weight, 1e-5, res))
        if dim % 32 == 0:
            qkv = rand(5, (kv_heads * group + 2 * kv_heads) * dim).to(dtype)
            qr = qkv[:, : kv_heads * group * dim].view(5, kv_heads * group, dim)
            kr = qkv[:, kv_heads * group * dim :][:, : kv_heads * dim].view(5, kv_heads, dim)
            cos, sin = rand(5, dim).to(dtype), rand(5, dim).to(dtype)
            checks["rotary"] = (_rotary(qr, kr, cos, sin, (_token_stride(qr), _token_stride(kr))),
                                reference.rotary(qr, kr, cos, sin))
        gate_up = (rand(5, 2 * 96) * 4).to(dtype)
        checks["SwiGLU"] = ([_silu_and_mul(gate_up)], [reference.silu_and_mul(gate_up)])
        if dtype == torch.float32 and dim == 64:  # once; scores with a ragged tail
            scores = rand(3, 1000) * 5
            checks["softmax top-k"] = (_softmax_topk(scores, 8),
                                       reference.softmax_topk(scores, 8))
        for name, (got, want) in checks.items():
            if not _agrees(got, want, dtype):
                log.warning("The CPU kernels' %s disagrees with the reference (%s, head dim "
                            "%d): the reference ops run instead.", name, dtype, dim)
                return False
    return True
