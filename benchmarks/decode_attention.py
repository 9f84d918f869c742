"""The C decode attention kernel (kernels/cpu_kernels.py) against the torch reference, on the
demo model's head shapes, over contexts and row counts a decode or verification step meets.

Each case is one layer's decode attention: `rows` query rows (9 heads sharing 3 KV heads of 64,
bfloat16 by default) whose keys sit at scattered slots of a paged cache, rows of one sequence as
speculative verification makes them (row j sees the context and j more keys). The two sides
alternate in rounds in one process. Prints one JSON object: the machine, per case the median
microseconds of each side, the ratio, and the kernel's time per extra row. Run it under
benchmarks/before_after.py to compare the kernel with an earlier revision's:

    python benchmarks/decode_attention.py
    python benchmarks/before_after.py --before HEAD~1 --figure cases.400x16.c_us \\
        -- benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine.bench import machine  # noqa: E402
from kernels import cpu_kernels, reference  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402

HEADS, KV_HEADS, DIM, SLOTS = 9, 3, 64, 8192


def case(context: int, rows: int, dtype: torch.dtype, gen: torch.Generator):
    """The arguments of one layer's decode attention: `rows` verification rows of a sequence
    with `context` keys before them, its keys at random slots."""
    k_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(dtype)
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
    width = context + rows
    slots = torch.randperm(SLOTS, generator=gen)[:width].repeat(rows, 1)
    lengths = torch.tensor([context + j + 1 for j in range(rows)])
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1))[:, None, None]
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long),
                             decode_token_index=torch.arange(rows), decode_slots=slots,
                             decode_lengths=lengths, decode_mask=mask)
    return q, k_cache, v_cache, meta, DIM ** -0.5


def timed_us(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[100, 400, 1600])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=40, help="calls per side per round")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("The C kernels did not build or pass their self-check here: nothing "
                         "to compare (see the log).")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    sides = {"c": cpu_kernels.decode_attention, "reference": reference._decode_attention}
    cases = {}
    for context in args.contexts:
        for rows in args.rows:
            call = case(context, rows, dtype, gen)
            want = sides["reference"](*call).float()
            diff = float((sides["c"](*call).float() - want).abs().max())
            times = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side, fn in sides.items():
                    fn(*call)
                    times[side].append(timed_us(fn, call, args.calls))
            median = {side: statistics.median(v) for side, v in times.items()}
            cases[f"{context}x{rows}"] = {
                "context": context, "rows": rows,
                "c_us": round(median["c"], 1), "reference_us": round(median["reference"], 1),
                "speedup": round(median["reference"] / median["c"], 2),
                "max_abs_diff": diff}
    for context in args.contexts:  # what one more verification row costs the kernel
        one, most = cases[f"{context}x{min(args.rows)}"], cases[f"{context}x{max(args.rows)}"]
        if most["rows"] > one["rows"]:
            most["c_us_per_extra_row"] = round(
                (most["c_us"] - one["c_us"]) / (most["rows"] - one["rows"]), 2)
    print(json.dumps({
        "benchmark": "decode_attention", "machine": machine(),
        "baseline": "the torch reference decode attention (gather and SDPA), same process, "
                    "alternating rounds",
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": args.dtype,
                  "threads": torch.get_num_threads()},
        "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
