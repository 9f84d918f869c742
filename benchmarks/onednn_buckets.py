"""oneDNN linear layers with row buckets (kernels/onednn.padded_rows) against exact row counts.

A server's steps carry every token count from 1 to max_num_batched_tokens; oneDNN builds and
caches a primitive per input shape. This measures, on the demo model's real layer shapes
(read from its GGUF) and its real weights:

- resident memory after sweeping the row counts 1..2,048 (every fifth) twice, each way in a fresh
  process (oneDNN's cache is per process): exact rows vs bucketed rows;
- time per call of every layer's linears at sample row counts, bucketed over exact (the price
  of the padded rows), and its mean over all row counts 1..2,048 weighted alike.

    python benchmarks/onednn_buckets.py              # memory and time
    python benchmarks/onednn_buckets.py --time-only  # time only (a minute)
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine.bench import machine  # noqa: E402
from kernels import onednn  # noqa: E402

SAMPLE_ROWS = (1, 7, 16, 17, 24, 33, 100, 129, 200, 300, 513, 700, 1000, 1500, 2048)


def _rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def _demo_weights() -> tuple[list[torch.Tensor], list[int]]:
    """The first decoder layer's fused matmul weights, as the engine prepares them."""
    from engine.loader import load_checkpoint
    from engine.models import fetch_demo_model

    ckpt = load_checkpoint(fetch_demo_model(progress=lambda message, fraction: None))
    t, p = ckpt.tensors, "model.layers.0."
    qkv = torch.cat([t[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]])
    raw = [qkv, t[p + "self_attn.o_proj.weight"], gate_up, t[p + "mlp.down_proj.weight"]]
    return [onednn.prepare_linear(w.float().contiguous()) for w in raw], [w.shape[1] for w in raw]


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _layer(fn, weights, widths, rows: int) -> None:
    for w, k in zip(weights, widths, strict=True):
        fn(torch.ones(rows, k), w)


def memory_child(mode: str) -> None:
    """One way's sweep in this process; prints its resident memory as JSON."""
    weights, widths = _demo_weights()
    fn = onednn.linear if mode == "bucketed" else _exact
    out = {"start_mb": round(_rss_mb(), 1), "after_sweep_mb": []}
    with torch.inference_mode():
        for _ in range(2):
            for rows in range(1, 2049, 5):
                _layer(fn, weights, widths, rows)
            out["after_sweep_mb"].append(round(_rss_mb(), 1))
    print(json.dumps(out))


def _time_both(weights, widths, rows: int, repeats: int = 15) -> tuple[float, float]:
    """Median seconds of one layer's linears at `rows`, exact and bucketed, the two timed in
    alternation so that other load on the machine falls on both alike."""
    ways = {"exact": (_exact, []), "bucketed": (onednn.linear, [])}
    with torch.inference_mode():
        for fn, _ in ways.values():
            _layer(fn, weights, widths, rows)  # build the primitives first
        for _ in range(repeats):
            for fn, runs in ways.values():
                t0 = time.perf_counter()
                _layer(fn, weights, widths, rows)
                runs.append(time.perf_counter() - t0)
    return tuple(statistics.median(runs) for _, runs in ways.values())


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--memory-child":
        memory_child(sys.argv[2])
        return
    if not onednn.available():
        print(json.dumps({"benchmark": "onednn_buckets", "machine": machine(),
                          "skipped": "this PyTorch build has no oneDNN linear ops"}))
        return
    memory = {}
    for mode in () if "--time-only" in sys.argv else ("exact", "bucketed"):
        child = subprocess.run([sys.executable, __file__, "--memory-child", mode],
                               capture_output=True, text=True, check=True)
        memory[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    weights, widths = _demo_weights()
    per_rows = {}
    for rows in SAMPLE_ROWS:
        exact, padded = _time_both(weights, widths, rows)
        per_rows[rows] = {"padded_to": onednn.padded_rows(rows), "exact_ms": round(exact * 1e3, 3),
                          "bucketed_ms": round(padded * 1e3, 3),
                          "ratio": round(padded / exact, 3)}
    extra_rows = [onednn.padded_rows(m) / m for m in range(1, 2049)]
    growth = {m: round(v["after_sweep_mb"][-1] - v["after_sweep_mb"][0], 1)
              for m, v in memory.items()}
    weighted = statistics.mean(v["ratio"] for v in per_rows.values())
    print(json.dumps({
        "benchmark": "onednn_buckets", "machine": machine(),
        "memory_mb": memory,
        "growth_after_first_sweep_mb": growth,
        "time_per_layer": per_rows,
        "time_ratio_bucketed_over_exact_median": round(statistics.median(
            v["ratio"] for v in per_rows.values()), 3),
        "time_ratio_bucketed_over_exact_mean": round(weighted, 3),
        "rows_ratio_mean_1_to_2048": round(statistics.mean(extra_rows), 4),
        "rows_ratio_max": round(max(extra_rows), 3),
        "distinct_shapes_1_to_2048": len({onednn.padded_rows(m) for m in range(1, 2049)}),
    }, indent=1))


if __name__ == "__main__":
    main()
