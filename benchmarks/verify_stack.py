"""A decode step's layers (cpu_kernels.c's decode_layers, the one C call of kernels/cpu_layers.py)
on real calls of 1 to N rows, at an earlier revision and in the working tree, in one process,
alternating; prints one JSON object.

The calls are captured from the demo model answering open-chat prompts with its trained draft's
trees (`demo-draft:lookup=0,branches=4`), so each row count is a real step: 1 row a plain decode
step, 2-13 a verify step of a draft tree, with the sequence's own context and KV cache. Each is
then replayed with both builds of the kernels, which are loaded side by side, in turns; a replay
rewrites the KV slots its call writes with the same values.
Why not tile_kernel_rows.py: it calls each matmul from Python, and its cold pass over the 30
layers carried about 120 ctypes calls, 40-70 us a layer on the 2-core EPYC against a 1-row
layer's 120 us of weight stream, which hid how much more a 4-row layer cost than a 1-row one.
Outputs of both builds are compared: a change that keeps the arithmetic leaves them identical.

    python benchmarks/verify_stack.py --before HEAD~1 [--rows 1 2 3 4 5 6 8] [--rounds 6]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import OPEN_CHAT, machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from kernels import cpu_kernels, cpu_layers  # noqa: E402

SPEC = "demo-draft:lookup=0,branches=4"
PROMPTS = OPEN_CHAT[:3]
CALLS = 8  # replays per timing


def _tile_kernel_rows():
    """benchmarks/tile_kernel_rows.py (its build of the kernels), loaded by path."""
    spec = importlib.util.spec_from_file_location("tile_kernel_rows", _HERE / "tile_kernel_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def builds(before: str, directory: Path) -> dict[str, ctypes.CDLL]:
    """The kernels at `before` and in the working tree, built as the engine builds them."""
    root = _HERE.parent
    old = subprocess.run(["git", "show", f"{before}:kernels/cpu_kernels.c"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    build = _tile_kernel_rows().build
    libs = {"before": build(old, directory, "before"),
            "after": build((root / "kernels" / "cpu_kernels.c").read_text(), directory, "after")}
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for lib in libs.values():  # cpu_kernels.py's signature of decode_layers
        lib.decode_layers.argtypes = ([p, i64] + [p] * 7 + [i64] * 8 + [p, i64, p] + [f32, f32]
                                      + [i32] * 4)
        lib.decode_layers.restype = i32
    return libs


def captured_calls(rows: list[int], max_tokens: int) -> dict[int, tuple]:
    """The first decode-only DecodeStack.run call of each row count in `rows` (its arguments,
    the step's inputs copied), from a speculative run of the demo model."""
    calls: dict[int, tuple] = {}
    run = cpu_layers.DecodeStack.run

    def capture(stack, h, cos, sin, meta, kv_caches, streams=None):
        if not meta.prefills and h.shape[0] in rows and h.shape[0] not in calls:
            calls[h.shape[0]] = (stack, h.clone(), cos.clone(), sin.clone(), meta, kv_caches)
        return run(stack, h, cos, sin, meta, kv_caches, streams)

    cpu_layers.DecodeStack.run = capture
    try:
        llm = LLM(str(fetch_demo_model(progress=lambda m, f: None)), device="cpu",
                  speculative=SPEC)
        for prompt in PROMPTS:
            llm.chat([{"role": "user", "content": prompt}],
                     SamplingParams(temperature=0, max_tokens=max_tokens))
    finally:
        cpu_layers.DecodeStack.run = run
    return calls


def replay(call: tuple, lib: ctypes.CDLL) -> torch.Tensor | None:
    """The call run with `lib` as the kernels; the last layer's output (None: it refused)."""
    library = cpu_kernels._library
    cpu_kernels._library = lambda: lib
    try:
        out = cpu_layers.DecodeStack.run(*call)
    finally:
        cpu_kernels._library = library
    return None if out is None else out[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier git revision")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(args.before, Path(tmp))
        calls = captured_calls(args.rows, args.max_tokens)
        if not calls:
            raise SystemExit("No decode step of those row counts ran here (the stack does not "
                             "take this CPU's steps, or no draft was verified): nothing to time.")
        # Each row count's two builds back to back, so the KV slots both read are the same.
        outputs = {n: [replay(call, lib) for lib in libs.values()] for n, call in calls.items()}
        times: dict[int, dict[str, list[float]]] = {n: {s: [] for s in libs} for n in calls}
        for i in range(args.rounds):
            for n, call in sorted(calls.items()):
                sides = list(libs) if i % 2 == 0 else list(libs)[::-1]
                for side in sides:
                    replay(call, libs[side])
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        replay(call, libs[side])
                    times[n][side].append((time.perf_counter() - start) / CALLS * 1e3)
    result = {
        "benchmark": "verify_stack", "before": args.before, "spec": SPEC, "machine": machine(),
        "baseline": "the kernels at --before, loaded beside the working tree's, alternating",
        "outputs_identical": all(a is not None and b is not None and torch.equal(a, b)
                                 for a, b in outputs.values()),
        "missing_rows": [n for n in args.rows if n not in calls],
        "rows": {}}
    for n in sorted(calls):
        before, after = (statistics.median(times[n][s]) for s in ("before", "after"))
        result["rows"][str(n)] = {"before_ms": round(before, 3), "after_ms": round(after, 3),
                                  "after_over_before": round(after / before, 3)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
