"""A tile kernel (cpu_kernels.c's bf16_linear, int4_linear or int8_linear with --kernel) at an
earlier revision and in the working tree, in one process: a decoder layer's four matmuls of the
demo model by rows per call.

Engine-level before/after runs (before_after.py) run each revision in its own process, and on
the shared 2-core VM those moved by 10-30% between processes (a batch-1 decode step read 8.0-15.3
ms in one hour); here both builds of the kernel are loaded side by side and called in turns on
the same weights and inputs, so the ratio is the kernel's own. Both builds' outputs are compared
too: a change that keeps the arithmetic must leave them identical to the bit (a row's sums may
not depend on how rows are blocked); one that changes it (the AVX2 int4 kernel's 16-bit
activations) reports them different.

The weights are the demo model's layer shapes (SmolLM2-135M: hidden 576, 9 query and 3 KV heads
of 64, MLP 1536), random, in the kernel's layout (int4: groups of 32, as the demo's Q4_1; int8:
per-output scales, as Int8Linear and the int4 formats' LM head);
timings are with warm caches (each matmul is called 100 times in a row), so they show the
kernel's compute and latency, not the weight stream from memory a real decode step pays on top.
With --cold the demo model's 30 layers each get their own weights (212 MB in bfloat16, far past
the caches) and a timing is a pass over all of them, layer after layer as a decode step reads
them: the weights stream from memory, and the figure is a layer's share of the pass.

    python benchmarks/tile_kernel_rows.py --before HEAD~1 [--kernel int4|int8] [--rows 1 2 4 16 17]
        [--rounds 5] [--cold]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine.bench import machine  # noqa: E402
from kernels import cpu_kernels, cpu_linear  # noqa: E402

ROOT = _HERE.parent
# (outputs, inputs) of the demo model's q/k/v, o, gate/up and down projections.
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
CALLS = 100  # per matmul and timing
LAYERS = 30  # the demo model's, each with its own weights under --cold
COLD_PASSES = 5  # timed passes over all the layers under --cold (the fastest counts)
INT4_GROUP = 32


def build(source: str, directory: Path, name: str) -> ctypes.CDLL:
    """The kernel source compiled as the engine compiles it (cpu_kernels.FLAGS), loaded."""
    src, lib = directory / f"{name}.c", directory / f"{name}.so"
    src.write_text(source)
    compiler = shutil.which("gcc") or shutil.which("cc")
    subprocess.run([compiler, *cpu_kernels.FLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                   capture_output=True, timeout=300)
    loaded = ctypes.CDLL(str(lib))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    loaded.bf16_linear.argtypes = [p, p, p, p, i64, i64, i64, i32, i32]
    loaded.int4_linear.argtypes = [p] * 5 + [i64] * 4 + [i32, i32]
    loaded.int8_linear.argtypes = [p, p, p, p, i64, i64, i64, i32, i32]
    return loaded


def random_weights(kernel: str, gen: torch.Generator) -> dict:
    """Per matmul of LAYER, its weight in the kernel's layout: bfloat16 tiles, int4 codes with
    float16 scales and mins per group (cpu_quant.pack's layout), or int8 codes with bfloat16
    scales per output."""
    weights = {}
    for name, (out, inn) in LAYER.items():
        if kernel == "bf16":
            w = torch.randn(out, inn, generator=gen).to(torch.bfloat16)
            weights[name] = (cpu_linear.tile_layout(w),)
        elif kernel == "int8":
            codes = torch.randint(-127, 128, (out // 16, inn // 2, 32), generator=gen,
                                  dtype=torch.int8)
            scales = (torch.rand(out, generator=gen) * 0.02).to(torch.bfloat16)
            weights[name] = (codes, scales)
        else:
            tiles, groups = out // 16, inn // INT4_GROUP
            codes = torch.randint(0, 256, (tiles, inn // 4, 32), generator=gen,
                                  dtype=torch.uint8)
            scales = (torch.rand(tiles, groups, 16, generator=gen) * 0.02).to(torch.float16)
            mins = (-torch.rand(tiles, groups, 16, generator=gen) * 0.1).to(torch.float16)
            weights[name] = (codes, scales, mins)
    return weights


def layer_calls(lib: ctypes.CDLL, kernel: str, weights: dict, inputs: dict,
                rows: int) -> tuple[list, list]:
    """One layer's four matmuls of `rows` rows as argument-free calls, and their outputs."""
    calls, outputs = [], []
    threads = torch.get_num_threads()
    for name, (out, inn) in LAYER.items():
        x, w = inputs[name][:rows].contiguous(), weights[name]
        y = torch.empty(rows, out, dtype=torch.bfloat16)
        if kernel in ("bf16", "int8"):  # one signature: the int8 scales where a bias goes
            per_out = w[1].data_ptr() if kernel == "int8" else None
            args = (x.data_ptr(), w[0].data_ptr(), per_out, y.data_ptr(), rows, inn, out, 1,
                    threads)
            fn = getattr(lib, f"{kernel}_linear")
        else:
            args = (x.data_ptr(), *(t.data_ptr() for t in w), y.data_ptr(), rows, inn, out,
                    INT4_GROUP, 1, threads)
            fn = lib.int4_linear

        def call(fn=fn, args=args, x=x):  # x: its buffer must outlive the call
            if fn(*args):
                raise RuntimeError(f"{fn.__name__} refused")

        calls.append(call)
        outputs.append(y)
    return calls, outputs


def layer_us(lib: ctypes.CDLL, kernel: str, weights: dict, inputs: dict,
             rows: int) -> tuple[float, list]:
    """Microseconds for one layer's four matmuls of `rows` rows (each called CALLS times in a
    row: warm caches), and their outputs."""
    total = 0.0
    calls, outputs = layer_calls(lib, kernel, weights, inputs, rows)
    for call in calls:
        for _ in range(5):
            call()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        total += (time.perf_counter() - start) / CALLS
    return total * 1e6, [y.clone() for y in outputs]


def cold_layer_us(lib: ctypes.CDLL, kernel: str, layers: list[dict], inputs: dict,
                  rows: int) -> tuple[float, list]:
    """Microseconds a layer's four matmuls of `rows` rows take within a pass over all `layers`
    (each its own weights, so they stream from memory), and the first layer's outputs."""
    per_layer = [layer_calls(lib, kernel, w, inputs, rows) for w in layers]
    calls = [call for layer, _ in per_layer for call in layer]
    for call in calls:
        call()
    best = float("inf")
    for _ in range(COLD_PASSES):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - start)
    return best / len(layers) * 1e6, [y.clone() for y in per_layer[0][1]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the earlier git revision")
    p.add_argument("--kernel", choices=["bf16", "int4", "int8"], default="bf16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 17, 20, 24])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold", action="store_true",
                   help="30 layers' own weights, streaming from memory as in a decode step")
    args = p.parse_args(argv)
    if not cpu_linear.available():
        print(json.dumps({"error": "the tile kernel does not run here (no AVX512-BF16, "
                                   "nor AVX2 with FMA and F16C)"}))
        return 1
    before_source = subprocess.run(["git", "show", f"{args.before}:kernels/cpu_kernels.c"],
                                   cwd=ROOT, capture_output=True, text=True, check=True).stdout
    gen = torch.Generator().manual_seed(0)
    layers = [random_weights(args.kernel, gen) for _ in range(LAYERS if args.cold else 1)]
    inputs = {n: torch.randn(max(args.rows), i, generator=gen).to(torch.bfloat16)
              for n, (_, i) in LAYER.items()}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": build(before_source, Path(tmp), "before"),
                "after": build(cpu_kernels.SOURCE.read_text(), Path(tmp), "after")}
        times: dict = {side: {r: [] for r in args.rows} for side in libs}
        identical = True
        for _ in range(args.rounds):
            for rows in args.rows:
                outs = {}
                for side, lib in libs.items():
                    if args.cold:
                        us, outs[side] = cold_layer_us(lib, args.kernel, layers, inputs, rows)
                    else:
                        us, outs[side] = layer_us(lib, args.kernel, layers[0], inputs, rows)
                    times[side][rows].append(us)
                identical &= all(torch.equal(a, b) for a, b in zip(*outs.values(), strict=True))
    result = {"benchmark": "tile_kernel_rows", "machine": machine(), "before": args.before,
              "baseline": "the kernel at --before, loaded beside the working tree's, alternating",
              "layer": "the demo model's q/k/v, o, gate/up and down matmuls, "
                       + ("a layer's share of a pass over 30 layers' own weights (from memory)"
                          if args.cold else "warm caches"),
              "kernel": args.kernel, "threads": torch.get_num_threads(),
              "outputs_identical": identical, "rows": {}}
    for rows in args.rows:
        before, after = (statistics.median(times[s][rows]) for s in ("before", "after"))
        result["rows"][str(rows)] = {"before_us": round(before, 1), "after_us": round(after, 1),
                                     "after_over_before": round(after / before, 3)}
    print(json.dumps(result, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
