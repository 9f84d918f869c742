"""This machine as a planner device: its read bandwidth, matmul throughput per precision and the
engine's per-step overhead, measured here and written where the planner's catalog reads it
(`<config dir>/catalogs/machine.toml`), so the planner can size a deployment of the demo model
on this machine and the plan can then be run and measured on it.

The planner's catalog holds peak figures and multiplies them by its achieved fractions
(planner.timing.Efficiency: 0.8 of bandwidth, 0.5 of FLOP/s). A micro-benchmark measures what
is achieved, so the entry stores achieved / fraction: an uncalibrated plan then predicts the
measured rates, and a calibration from runs made here corrects the rest.

Each engine that serves plans here has step costs of its own (vLLM's CPU build runs one thread
beside a reserved core and falls back to torch's linear where oneDNN has no bfloat16 kernel;
servescope runs two), so the entry also holds, per engine, what that engine's own prefill and
decode steps at batch 1 and 4 say: the matmul rate it reaches, a fixed cost per step and a cost
per sequence in the step (sampling, per-sequence attention and bookkeeping), fitted by
inverting the planner's step model (`fit_engine`). servescope's are measured here; another
engine's timings come in a JSON file naming the engine (`--engine-timings FILE`, made by
app/vllm_local.py's `--steps` in vLLM's own Python).

`servescope plan machine` runs it: `python -m engine.device_profile [--write CONFIG_DIR]
[--quick] [--engine-timings FILE ...]` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

import kernels
from engine.bench import timed_calls

# planner.timing.Efficiency's defaults (this module cannot import the planner, nor it torch).
PLANNER_MEMORY_FRACTION = 0.8
PLANNER_FLOPS_FRACTION = 0.5
# The precisions the planner names, and the torch dtype whose matmul stands for each here (the
# planner has no float32: plans on a CPU run in bfloat16, vLLM's CPU default too).
MATMUL_DTYPES = {"bf16": torch.bfloat16}
ENTRY_FILE = "machine.toml"


def best_seconds(work, repeats: int) -> float:
    """The fastest of `repeats` timed runs after one warm-up (the least disturbed one)."""
    return min(timed_calls(work, repeats))


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


def demo_llm():
    """The demo model in bfloat16 (as plans run here), fetched on first use."""
    from engine import LLM
    from engine.models import DEMO_MODEL, fetch_demo_model

    fetch_demo_model(progress=lambda message, fraction: None)
    return LLM(DEMO_MODEL, device="cpu", dtype="bfloat16")


def best_decode_step_ms(llm, tokens: int = 32) -> float:
    """The demo engine's least disturbed batch-1 decode step (bfloat16), in ms. (The least
    disturbed, as for the other figures: on a shared machine the median swung 5x between runs.)"""
    from engine import SamplingParams

    llm.add_request("The planner measures this machine:", SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True))
    steps = []
    while llm.has_unfinished():
        start = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - start)
    return min(steps[1:]) * 1e3  # the first step is the prefill


def engine_read_gbs(read_bytes: int, step_ms: float) -> float:
    """The read bandwidth a decode step that reads `read_bytes` in `step_ms` reached at least,
    rounded up (so that reading at it never takes longer than the step did)."""
    return math.ceil(read_bytes / (step_ms * 1e-3) / 1e9 * 100) / 100


def step_overhead_ms(step_ms: float, read_bytes: int, bandwidth_gbs: float,
                     tflops: float) -> dict:
    """The demo engine's batch-1 decode step against what the planner's roofline gives it: the
    longer of reading its weights at the measured bandwidth and multiplying by them at the
    measured matmul rate. The rest (Python, scheduling, small kernels) is a fixed cost per step
    to the planner, which then predicts this step at batch 1 and adds FLOPs and KV reads above
    it. (On a CPU without bfloat16 instructions the multiply is the longer one: a profile that
    subtracted only the read predicted 52.7 ms for a measured 39.6 ms step.)"""
    weights_ms = read_bytes / (bandwidth_gbs * 1e9) * 1e3
    # One multiply-add per weight read (bfloat16: 2 bytes a weight) for the one token.
    flops_ms = 2.0 * (read_bytes / 2) / (tflops * 1e12) * 1e3
    return {"decode_step_ms": round(step_ms, 3), "weights_read_ms": round(weights_ms, 3),
            "matmul_ms": round(flops_ms, 3),
            "overhead_ms": round(max(0.0, step_ms - max(weights_ms, flops_ms)), 3)}


# The batches whose decode steps an engine's timings hold: two sizes separate a step's fixed
# cost from its cost per sequence; a third, as large as the batches plans run here, keeps one
# noisy timing from setting the cost per sequence alone (vLLM timed at 1 and 4 once fitted no
# cost per sequence and timed batch 4 27% long; at 1, 4 and 8 its steps are 41, 130, 269 ms).
STEP_BATCHES = (1, 4, 8)
PROFILE_PROMPT_TOKENS = 52


def servescope_timings(llm, tokens: int = 16,
                       prompt_tokens: int = PROFILE_PROMPT_TOKENS) -> dict:
    """servescope's own engine timed as `fit_engine` reads any engine: one prompt of
    `prompt_tokens` tokens prefilled alone, and decode steps at each of STEP_BATCHES (the least
    disturbed of `tokens` steps each), bfloat16 as plans run."""
    from engine import SamplingParams

    def prompt(n: int) -> list[int]:  # distinct token ids: no prefix-cache hit between them
        return [1000 + 97 * n + t for t in range(prompt_tokens)]

    prefill_ms, decode_ms = [], {}
    for n in range(3):
        llm.add_request(prompt(n), SamplingParams(temperature=0.0, max_tokens=1,
                                                  ignore_eos=True))
        start = time.perf_counter()
        while llm.has_unfinished():
            llm.step()
        prefill_ms.append((time.perf_counter() - start) * 1e3)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for batch in STEP_BATCHES:
        for i in range(batch):
            llm.add_request(prompt(10 + 10 * batch + i), params)
        steps = []
        while llm.has_unfinished():
            start = time.perf_counter()
            _, stats = llm.step()
            if not stats.num_prefill_tokens and stats.num_decode_tokens == batch:
                steps.append((time.perf_counter() - start) * 1e3)
        decode_ms[str(batch)] = round(min(steps), 3)
    return {"engine": "servescope", "dtype": "bfloat16", "prompt_tokens": prompt_tokens,
            "prefill_ms": round(min(prefill_ms), 3), "decode_ms": decode_ms}


def demo_shape(llm) -> dict:
    """What the fits need of the demo model, from its own weights: the bytes a decode step reads
    (every weight but the embedding table, of which it looks up one row; a tied head prepared
    apart from it is a matrix of its own, read in full) and the LM head's share of them (a
    prompt's tokens skip the head, but its last)."""
    from engine.model import weight_nbytes

    model = llm.model
    embedding = model.embed.numel() * model.embed.element_size()
    head = weight_nbytes(model.lm_head)
    read = llm.weight_bytes - (embedding if model.lm_head is not model.embed else 0)
    return {"read_bytes": read, "head_bytes": head}


def fit_engine(timings: dict, shape: dict, bandwidth_gbs: float) -> dict:
    """An engine's matmul rate, step cost and per-sequence cost, such that the planner's step
    model (planner/timing.py: fixed cost + per-sequence cost x sequences + the longer of reading
    and multiplying by the weights) gives back the timed prefill and decode steps.

    The decode batches give the fixed and per-sequence costs once the rate is known (a least-
    squares line through what each step takes beyond the roofline), and the prefill (many
    tokens, one sequence) gives the rate once those are: the rate that makes them all agree is
    found on a log grid (the model is not linear in it: the roofline's max)."""
    read, head = shape["read_bytes"], shape["head_bytes"]
    decode_flops = read  # 2 FLOPs per 2-byte bfloat16 weight, per token
    prompt = timings["prompt_tokens"]
    prefill_flops = prompt * (read - head) + head
    weights_s = read / (bandwidth_gbs * 1e9)
    # Every batch timed (older timings hold 1 and 4 only).
    batches = np.array(sorted(int(b) for b in timings["decode_ms"]), dtype=float)
    steps = np.array([timings["decode_ms"][str(int(b))] * 1e-3 for b in batches])
    t_prefill = timings["prefill_ms"] * 1e-3

    def costs(rate: float) -> tuple[float, float, float, float]:
        """(fixed, per sequence, prefill error, squared relative error of every timing) at a
        matmul rate of `rate` FLOP/s: what the decode steps take beyond the roofline, fitted by
        least squares as fixed + per sequence x batch (neither negative)."""
        linear = np.maximum(batches * decode_flops / rate, weights_s)
        rest = steps - linear
        per_seq = max(0.0, float(np.polyfit(batches, rest, 1)[0]))
        fixed = max(0.0, float(np.mean(rest - per_seq * batches)))
        prefill = fixed + per_seq + max(prefill_flops / rate, weights_s)
        decode_errors = (fixed + per_seq * batches + linear - steps) / steps
        prefill_error = (prefill - t_prefill) / t_prefill
        return fixed, per_seq, abs(prefill_error), prefill_error ** 2 + float(
            np.sum(decode_errors ** 2))

    rates = np.geomspace(1e8, 1e15, 4000)
    best = min(rates, key=lambda rate: costs(rate)[3])
    fixed, per_seq, error, _ = costs(best)
    return {"engine": timings["engine"], "dtype": timings.get("dtype", "bfloat16"),
            "tflops_bf16": round(best / 1e12, 5), "overhead_ms": round(fixed * 1e3, 3),
            "per_seq_ms": round(per_seq * 1e3, 3), "prefill_fit_error_pct":
            round(error * 100, 1), "timings": timings}


def memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def measure(quick: bool = False, engine_timings: list[dict] = ()) -> dict:
    """Every figure the planner's device entry needs, measured now; `engine_timings` are other
    engines' step timings (from their own environments) to fit beside servescope's."""
    from engine.bench import machine as machine_info

    repeats = 3 if quick else 7
    # Rounded before the fits use it: the stored profile then reproduces its own fits.
    reduction = round(read_bandwidth_gbs(256 if quick else 512, repeats), 2)
    tflops = {name: matmul_tflops(dtype, 1024, repeats)
              for name, dtype in MATMUL_DTYPES.items()}
    llm = demo_llm()
    shape = demo_shape(llm)
    step_ms = best_decode_step_ms(llm, 16 if quick else 32)
    timings = [servescope_timings(llm, 8 if quick else 16), *engine_timings]
    # The engine's own batch-1 step is a read of its weights too, and one the reduction may not
    # match: with its layers in one C call and the AMX kernel prefetching its tiles, the demo
    # model's step read its weights faster than torch's sum read a buffer (an 18.7 ms step
    # against a 20.3 ms "read" at 13.3 GB/s), which left the planner a step shorter than its
    # own weights. The faster of the two stands.
    fastest = min([step_ms, timings[0]["decode_ms"]["1"]])
    from_step = engine_read_gbs(shape["read_bytes"], fastest)
    bandwidth = max(reduction, from_step)
    return {"machine": machine_info(), "read_bandwidth_gbs": bandwidth,
            "read_bandwidth_from": "decode step" if from_step > reduction else "reduction",
            "reduction_gbs": reduction,
            "matmul_tflops": {k: round(v, 4) for k, v in tflops.items()},
            "memory_gb": round(memory_gb(), 1),
            "step": step_overhead_ms(step_ms, shape["read_bytes"], bandwidth, tflops["bf16"]),
            "shape": shape,
            "engines": {t["engine"]: fit_engine(t, shape, bandwidth) for t in timings}}


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
        # Per engine, its rate over the same fraction as the device's.
        "engines": {name: {"tflops_bf16": round(e["tflops_bf16"] / PLANNER_FLOPS_FRACTION, 6),
                           "overhead_ms": e["overhead_ms"], "per_seq_ms": e["per_seq_ms"]}
                    for name, e in profile.get("engines", {}).items()},
        "source": (f"measured here by `python -m engine.device_profile`: read "
                   f"{bandwidth} GB/s, bf16 matmul {profile['matmul_tflops']['bf16']} TFLOP/s, "
                   f"stored over the planner's default fractions "
                   f"({PLANNER_MEMORY_FRACTION}, {PLANNER_FLOPS_FRACTION}); engine step "
                   f"overhead {profile['step']['overhead_ms']} ms; per engine, fitted to its "
                   f"own prefill and batch-{'/'.join(map(str, STEP_BATCHES))} decode steps: "
                   + ", ".join(f"{n} {e['tflops_bf16']} TFLOP/s, {e['overhead_ms']} ms a "
                               f"step, {e['per_seq_ms']} ms a sequence"
                               for n, e in profile.get("engines", {}).items())),
        "date": date.today().isoformat(),
    }


def toml_entry(name: str, entry: dict) -> str:
    """One `[gpu."name"]` table as TOML (JSON's string and number syntax is TOML's too); a
    table of tables (the engines) as sub-tables after it."""
    lines, after = [f"[gpu.{json.dumps(name)}]"], []
    for key, value in entry.items():
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            for sub, table in value.items():
                after.append(f"\n[gpu.{json.dumps(name)}.{key}.{json.dumps(sub)}]")
                after += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
        elif isinstance(value, dict):
            inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{key} = {{ {inner} }}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines + after) + "\n"


def write_entry(profile: dict, config_dir: Path) -> tuple[Path, Path | None]:
    """Replace the machine entry file (it holds only this machine: the user's own catalogs are
    never rewritten); (its path, where the file it replaced is kept, or None). The replaced file
    is kept beside it as PREVIOUS_SUFFIX: a plain re-run would otherwise drop what an earlier
    run measured (vLLM's step timings from `--vllm`), and the catalog reads only the named
    file, so the copy is inert until renamed back."""
    path = config_dir / "catalogs" / ENTRY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ("# Written by `python -m engine.device_profile --write`: this machine, measured.\n"
            + toml_entry(device_name(profile), catalog_entry(profile)))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    kept = None
    if path.is_file():
        kept = path.replace(previous_entry(path))
    tmp.replace(path)
    return path, kept


PREVIOUS_SUFFIX = ".prev"


def previous_entry(path: Path) -> Path:
    """Where write_entry keeps the entry file it replaced."""
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="CONFIG_DIR", type=Path,
                        help=f"write the planner's entry to CONFIG_DIR/catalogs/{ENTRY_FILE} "
                             "(`servescope plan machine` passes the app's config folder)")
    parser.add_argument("--quick", action="store_true", help="smaller, fewer measurements")
    parser.add_argument("--engine-timings", metavar="FILE", type=Path, action="append",
                        default=[], help="another engine's step timings, as JSON (app/"
                                         "vllm_local.py --steps writes vLLM's); repeatable")
    args = parser.parse_args(argv)
    profile = measure(args.quick, [json.loads(p.read_text()) for p in args.engine_timings])
    profile["entry"] = {"name": device_name(profile), **catalog_entry(profile)}
    if args.write is not None:
        written, kept = write_entry(profile, args.write)
        profile["written"] = str(written)
        if kept is not None:
            profile["replaced"] = str(kept)
    print(json.dumps(profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
