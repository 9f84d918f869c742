"""Compile every Triton kernel for NVIDIA GPUs without one: Triton's compiler down to PTX and
its bundled ptxas to a cubin, for each variant the wrappers in kernels.triton_ops launch.

The interpreter the other tests use is lenient (no type or shape checks of tl.dot, no register
or shared-memory limits); this catches what only the real compiler would. Run as a script in a
process where TRITON_INTERPRET is unset (triton decides at import): `python
tests/kernels/compile_kernels.py 80 90 --dtypes bf16` prints one line per kernel and exits
non-zero on the first failure (a compile error, or more shared memory than consumer GPUs have).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import triton_ops as ops  # noqa: E402

# Scalar and pointer arguments by name; every other non-constexpr argument is an i32.
_ATTENTION = {"scale": "fp32", "row_ptr": "*i64", "slots_ptr": "*i64", "mask_ptr": "*i1",
              "mass_ptr": "*fp32", "part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}


def variants(dt: str, arch: int = 90) -> list[tuple]:
    """(kernel, pointer types, constexprs) for each launch the wrappers make with dtype dt; a
    quantized KV cache in int8 everywhere and in fp8 (e4m3) from sm_89, which converts it in
    hardware."""
    p = "*" + dt
    block = ops.prefill_block({"fp16": torch.float16, "bf16": torch.bfloat16,
                               "fp32": torch.float32}[dt])
    precision = "ieee" if dt == "fp32" else "tf32"
    plain = {"k_cache_ptr": p, "v_cache_ptr": p, "k_scale_ptr": p, "v_scale_ptr": p}
    caches = [(ops._PLAIN, plain), (ops._INT8, _quantized("*i8"))]
    if arch >= 89:
        caches.append((ops._FP8, _quantized("*fp8e4nv")))
    attention = {"q_ptr": p, "out_ptr": p, **_ATTENTION}
    decode = [(ops._decode_kernel, {**attention, **cache},
               {"HAS_MASK": mask, "SPLIT": split, "RETURN_MASS": mass, "QUANT": quant,
                "PRECISION": precision, "BLOCK_G": 16, "BLOCK_N": ops._DECODE_BLOCK_N,
                "BLOCK_D": d})
              for mask, split, mass, d in ((True, False, True, 64), (False, True, False, 128))
              for quant, cache in caches[: 1 if split else None]]
    prefill = [(ops._prefill_kernel, {**attention, **cache},
                {"HAS_MASK": mask, "RETURN_MASS": mass, "QUANT": quant, "PRECISION": precision,
                 "BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": d})
               for mask, mass, d in ((True, True, 64), (False, False, 128))
               for quant, cache in caches[: None if mass else 1]]
    store = [(ops._store_kv_kernel, {"k_ptr": p, "v_ptr": p, "slot_ptr": "*i64", **cache},
              {"QUANT": quant, "QMAX": qmax, "BLOCK_H": 8, "BLOCK_D": 128})
             for (quant, cache), qmax in zip(caches, (1.0, 127.0, 448.0), strict=False)]
    return [
        *decode,
        (ops._combine_kernel, {"out_ptr": p, "part_ptr": "*fp32", "m_ptr": "*fp32",
                               "l_ptr": "*fp32", "row_ptr": "*i64"},
         {"BLOCK_S": 16, "BLOCK_D": 128}),
        *prefill,
        *store,
        *[(ops._rms_norm_kernel, {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p,
                                  "res_out_ptr": p, "eps": "fp32"},
           {"HAS_RESIDUAL": residual, "BLOCK": 4096}) for residual in (False, True)],
        (ops._rotary_kernel, {n: p for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr",
                                             "q_out_ptr", "k_out_ptr")},
         {"BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": 64}),
        (ops._silu_and_mul_kernel, {"x_ptr": p, "out_ptr": p}, {"BLOCK": 1024}),
    ]


def _quantized(values: str) -> dict:
    return {"k_cache_ptr": values, "v_cache_ptr": values, "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32"}


def compile_kernel(fn, types: dict, constexprs: dict, target: GPUTarget):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs), target=target,
                          options={"num_warps": 4})


# The shared memory one block may use on consumer GPUs (sm_86 / sm_89); data-centre parts allow
# more, so a kernel within this fits everywhere.
SHARED_MEMORY_LIMIT = 99 * 1024


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", type=int, default=[90],
                        help="compute capabilities as integers (80 = sm_80)")
    parser.add_argument("--dtypes", default="fp16,bf16,fp32", help="comma-separated")
    args = parser.parse_args(argv)
    for arch in args.archs:
        target = GPUTarget("cuda", arch, 32)
        for dt in args.dtypes.split(","):
            for fn, types, constexprs in variants(dt, arch):
                kernel = compile_kernel(fn, types, constexprs, target)
                shared = kernel.metadata.shared
                quant = {1: " int8 KV", 2: " fp8 KV"}.get(constexprs.get("QUANT"), "")
                print(f"sm_{arch} {dt} {fn.__name__}{quant}: {len(kernel.asm['cubin'])} bytes of "
                      f"cubin, "
                      f"{shared} bytes of shared memory", flush=True)
                if shared > SHARED_MEMORY_LIMIT:
                    print(f"{fn.__name__} needs {shared} bytes of shared memory in {dt}, over "
                          f"the {SHARED_MEMORY_LIMIT} of consumer GPUs", file=sys.stderr)
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
