"""This machine as a planner device: its read bandwidth, matmul throughput per precision and the
engine's per-step overhead, measured here and written where the planner's catalog reads it
(`<config dir>/catalogs/machine.toml`), so the planner can size a deployment of the demo model
on this machine and the plan can then be run and measured on it.

The planner's catalog holds peak figures and multiplies them by its achieved fractions
(planner.timing.Efficiency: 0.8 of bandwidth, 0.5 of FLOP/s). A micro-benchmark measures what
is achieved, so the entry stores achieved / fraction: an uncalibrated plan then predicts the
measured rates, and a calibration from runs made here corrects the rest.

`servescope plan machine` runs it: `python -m engine.device_profile [--write CONFIG_DIR]
[--quick]` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch

import kernels

# planner.timing.Efficiency's defaults (this module cannot import the planner, nor it torch).
PLANNER_MEMORY_FRACTION = 0.8
PLANNER_FLOPS_FRACTION = 0.5
# The precisions the planner names, and the torch dtype whose matmul stands for each here (the
# planner has no float32: plans on a CPU run in bfloat16, vLLM's CPU default too).
MATMUL_DTYPES = {"bf16": torch.bfloat16}
ENTRY_FILE = "machine.toml"


def best_seconds(work, repeats: int) -> float:
    """The fastest of `repeats` timed runs after one warm-up (the least disturbed one)."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s reading a buffer much larger than the caches once (a reduction, as a decode step
    reads its weights)."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    seconds = best_seconds(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds / 1e9


def matmul_tflops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Dense TFLOP/s of a prefill-sized linear layer (n tokens, an n x n weight) at `dtype`,
    run as the engine runs its linear layers: the weight prepared and multiplied by the kernel
    table the engine picks here (oneDNN, else the reference's F.linear).

    A plain `a @ b` is not what the engine does and can be far off it: on a CPU without
    bfloat16 instructions, PyTorch's bfloat16 `a @ b` takes a scalar fallback (0.001 TFLOP/s on
    a 2-core AVX2 machine) while F.linear's transposed-weight path, the engine's, runs 25x
    faster there; a profile built on the former predicted a 330 ms decode step for a
    measured 42 ms one."""
    ops = kernels.ops_for("cpu", dtype)
    x = torch.randn(n, n).to(dtype)
    weight = ops.prepare_linear(torch.randn(n, n).to(dtype))
    seconds = best_seconds(lambda: ops.linear(x, weight), repeats)
    return 2.0 * n**3 / seconds / 1e12


def step_overhead_ms(bandwidth_gbs: float, tflops: float, tokens: int = 32) -> dict:
    """The demo engine's batch-1 decode step (bfloat16) against what the planner's roofline
    gives it: the longer of reading its weights at the measured bandwidth and multiplying by
    them at the measured matmul rate. The rest (Python, scheduling, small kernels) is a fixed
    cost per step to the planner, which then predicts this step at batch 1 and adds FLOPs and KV
    reads above it. (On a CPU without bfloat16 instructions the multiply is the longer one: a
    profile that subtracted only the read predicted 52.7 ms for a measured 39.6 ms step.)"""
    from engine import LLM, SamplingParams
    from engine.models import DEMO_MODEL, fetch_demo_model

    fetch_demo_model(progress=lambda message, fraction: None)
    llm = LLM(DEMO_MODEL, device="cpu", dtype="bfloat16")
    llm.add_request("The planner measures this machine:", SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True))
    steps = []
    while llm.has_unfinished():
        start = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - start)
    # The least disturbed decode step, as for the other figures (the first step is the
    # prefill): on a shared machine the median swung 5x between runs.
    step_ms = min(steps[1:]) * 1e3
    model = llm.model
    # What a decode step reads: every weight but the embedding, of which it looks up one row
    # (a tied head prepared apart from it is a matrix of its own, read in full).
    embedding = model.embed.numel() * model.embed.element_size()
    read = llm.weight_bytes - (embedding if model.lm_head is not model.embed else 0)
    weights_ms = read / (bandwidth_gbs * 1e9) * 1e3
    # One multiply-add per weight read (bfloat16: 2 bytes a weight) for the one token.
    flops_ms = 2.0 * (read / 2) / (tflops * 1e12) * 1e3
    return {"decode_step_ms": round(step_ms, 3), "weights_read_ms": round(weights_ms, 3),
            "matmul_ms": round(flops_ms, 3),
            "overhead_ms": round(max(0.0, step_ms - max(weights_ms, flops_ms)), 3)}


def memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def measure(quick: bool = False) -> dict:
    """Every figure the planner's device entry needs, measured now."""
    from engine.bench import machine as machine_info

    repeats = 3 if quick else 7
    bandwidth = read_bandwidth_gbs(256 if quick else 512, repeats)
    tflops = {name: matmul_tflops(dtype, 1024, repeats)
              for name, dtype in MATMUL_DTYPES.items()}
    return {"machine": machine_info(), "read_bandwidth_gbs": round(bandwidth, 2),
            "matmul_tflops": {k: round(v, 4) for k, v in tflops.items()},
            "memory_gb": round(memory_gb(), 1),
            "step": step_overhead_ms(bandwidth, tflops["bf16"], 16 if quick else 32)}


def device_name(profile: dict) -> str:
    """The processor's own name (what engine benchmark records carry), as the catalog name."""
    return profile["machine"].get("processor") or "this machine"


def catalog_entry(profile: dict) -> dict:
    """The planner's `[gpu."<name>"]` fields for this machine (see the module docstring)."""
    bandwidth = profile["read_bandwidth_gbs"]
    tflops = {"bf16": round(profile["matmul_tflops"]["bf16"] / PLANNER_FLOPS_FRACTION, 4)}
    return {
        "aliases": ["this machine", "local"],
        "memory_gb": profile["memory_gb"],
        "bandwidth_gbs": round(bandwidth / PLANNER_MEMORY_FRACTION, 2),
        "tflops": tflops,
        # One machine: nothing to shard across ("none" keeps the search at tp = pp = 1); the
        # link figures are never used.
        "interconnect": "none",
        "link_gbs": round(bandwidth, 2),
        "link_latency_us": 1.0,
        "power_w": 0,  # not measured: a CPU's package power is rarely readable without root
        "step_overhead_ms": profile["step"]["overhead_ms"],
        "source": (f"measured here by `python -m engine.device_profile`: read "
                   f"{bandwidth} GB/s, bf16 matmul {profile['matmul_tflops']['bf16']} TFLOP/s, "
                   f"stored over the planner's default fractions "
                   f"({PLANNER_MEMORY_FRACTION}, {PLANNER_FLOPS_FRACTION}); engine step "
                   f"overhead {profile['step']['overhead_ms']} ms"),
        "date": date.today().isoformat(),
    }


def toml_entry(name: str, entry: dict) -> str:
    """One `[gpu."name"]` table as TOML (JSON's string and number syntax is TOML's too)."""
    lines = [f"[gpu.{json.dumps(name)}]"]
    for key, value in entry.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{key} = {{ {inner} }}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def write_entry(profile: dict, config_dir: Path) -> Path:
    """Replace the machine entry file (it holds only this machine: the user's own catalogs are
    never rewritten)."""
    path = config_dir / "catalogs" / ENTRY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ("# Written by `python -m engine.device_profile --write`: this machine, measured.\n"
            + toml_entry(device_name(profile), catalog_entry(profile)))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="CONFIG_DIR", type=Path,
                        help=f"write the planner's entry to CONFIG_DIR/catalogs/{ENTRY_FILE} "
                             "(`servescope plan machine` passes the app's config folder)")
    parser.add_argument("--quick", action="store_true", help="smaller, fewer measurements")
    args = parser.parse_args(argv)
    profile = measure(args.quick)
    profile["entry"] = {"name": device_name(profile), **catalog_entry(profile)}
    if args.write is not None:
        profile["written"] = str(write_entry(profile, args.write))
    print(json.dumps(profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
