"""The CPU's int4 / int8 kernels (kernels/cpu_quant.py) against PyTorch's quantized ops and
against the default float weights, in real engine steps of the demo model with int4 weights,
alternating in one process.

Three engines load the demo model: `--weights int4` through the C kernels (the default where the
CPU has AVX512-BF16, or AVX2 with FMA and F16C; the LM head is int8 under every quantized
format), `--weights int4` through PyTorch's `_weight_int4pack_mm_for_cpu` and
`_weight_int8pack_mm` (the path before the kernels), and the default float weights (`float`:
bfloat16 where the CPU has bfloat16 instructions, else float32; `float_dtype` says which). For
each batch size each engine holds that many requests decoding (64-word prompts, greedy,
ignore_eos); every round runs a few steps of each in turn, so the machine's load falls on all
alike. A prefill of 16 fresh
prompts is timed the same way, and each layer shape's linear at a few row counts. Where the AMX
kernel runs (kernels/cpu_linear.amx_runs), a fourth engine holds the same int4 kernels with
their AMX row rule off (`c_int4_tile_loops`: the int4 loop up to cpu_quant.DEQUANTIZE_ROWS rows,
instead of int4_amx_linear from cpu_quant.AMX_MATMUL_ROWS), and a fifth runs the paths before
the AMX int4 / int8 kernels (`c_int4_decoded_whole`: each int4 weight decoded whole into bfloat16
tiles for the bfloat16 AMX kernel where int4_amx_linear would run, from 16 rows as then, and the
int8 LM head on the int8 loop at every row count). Prints one JSON object: the machine, the
median step times, and the ratios against PyTorch's op, against the float weights and, with AMX,
against the int4 loop and the paths before.

    python benchmarks/cpu_int4.py                   # batch 1 and 16, 10 rounds
    python benchmarks/cpu_int4.py --batch 16 --rounds 4
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from unittest import mock

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import LLM  # noqa: E402
from engine.bench import (  # noqa: E402
    alternating_decode_ms,
    alternating_prefill_ms,
    machine,
    median_call_us,
    step_summary,
)
from engine.engine_config import EngineConfig  # noqa: E402
from kernels import cpu_linear, cpu_quant, ops_for, quant  # noqa: E402
from monitor.loadgen import make_prompt  # noqa: E402

SIDES = ("c_int4", "pytorch_int4", "float")


def engines() -> dict[str, LLM]:
    """The three engines; PyTorch's op is what prepare_linear falls back to without the kernel."""
    out = {"c_int4": LLM(EngineConfig("smollm2-135m-instruct", weights="int4"))}
    with mock.patch.object(cpu_quant, "prepare", return_value=None):  # no kernel: the fallback
        out["pytorch_int4"] = LLM(EngineConfig("smollm2-135m-instruct", weights="int4"))
    out["float"] = LLM(EngineConfig("smollm2-135m-instruct"))
    if cpu_linear.amx_runs():
        out["c_int4_tile_loops"] = LLM(EngineConfig("smollm2-135m-instruct", weights="int4"))
        for layer in out["c_int4_tile_loops"].model.layers:
            for kernel in (layer.qkv, layer.o, layer.gate_up, layer.down):
                kernel.matmul_rows = 0
        whole = out["c_int4_decoded_whole"] = LLM(EngineConfig("smollm2-135m-instruct",
                                                               weights="int4"))
        whole.step = decoding_whole(whole.step)
        whole.model.lm_head.matmul_rows = 0
    kinds = {side: type(llm.model.layers[0].qkv).__name__ for side, llm in out.items()}
    if kinds["c_int4"] != "Int4Linear" or not isinstance(out["c_int4"].model.lm_head,
                                                           cpu_quant.Int8Linear):
        raise SystemExit("The int4 kernel does not run here (it needs AVX512-BF16 or AVX2 and "
                         f"a C compiler; the engine holds {kinds['c_int4']}): nothing to "
                         "compare.")
    return out


def decoding_whole(fn):
    """fn run with int4_amx_linear's rows sent where they went before it (both the model's
    linears and the one-call decode step ask cpu_quant.int4_path): the whole decode from 16
    rows, the int4 loop below."""
    def path(rows: int, matmul_rows: int, bf16: bool) -> int:
        chosen = real_path(rows, matmul_rows, bf16)
        if chosen != cpu_quant.INT4_AMX:
            return chosen
        return cpu_quant.INT4_WHOLE if rows >= 16 else cpu_quant.INT4_TILES

    real_path = cpu_quant.int4_path

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with mock.patch.object(cpu_quant, "int4_path", path):
            return fn(*args, **kwargs)
    return run


def decode_steps(llms: dict[str, LLM], batch: int, rounds: int, steps: int) -> dict:
    rng = np.random.default_rng(batch)
    prompts = [make_prompt(64, rng) for _ in range(batch)]
    return _summary(alternating_decode_ms(llms, prompts, rounds, steps))


def prefill_steps(llms: dict[str, LLM], prompts: int, rounds: int) -> dict:
    rng = np.random.default_rng(prompts)
    batches = [[make_prompt(64, rng) for _ in range(prompts)] for _ in range(rounds + 1)]
    return _summary(alternating_prefill_ms(llms, batches))


def layer_linears(llm: LLM, rounds: int, dtype: torch.dtype) -> dict:
    """Each layer shape's linear and the LM head at decode and prefill row counts: the kernel
    (by cpu_quant.int4_path / on_amx; with AMX also `c_tile_loop`, its AMX kernel off,
    `c_amx`, its AMX kernel at every row count, and for int4 `c_decoded_whole`, the weight
    decoded whole), PyTorch's op on the same codes, and the same weight decoded to the default
    float `dtype` as the CPU table runs it (oneDNN, or the bfloat16 tile kernel)."""
    table = ops_for("cpu", dtype)
    layer = llm.model.layers[0]
    kernels = {name: getattr(layer, name) for name in ("qkv", "o", "gate_up", "down")}
    kernels["lm_head (int8)"] = llm.model.lm_head
    out = {}
    for name, kernel in kernels.items():
        codes = _codes(kernel)
        theirs = quant.PackedInt4(codes) if codes.bits == 4 else quant.PackedInt8(codes)
        dense = table.prepare_linear(codes.dequantize(dtype))
        shape = f"{name} {kernel.out_features}x{kernel.in_features}"
        out[shape] = {}
        for rows in (1, 2, 4, 8, 16, 64, 256):
            x = torch.randn(rows, kernel.in_features).to(dtype)
            times = {"c": _time(functools.partial(kernel.linear, x), rounds),
                     "pytorch": _time(functools.partial(theirs.linear, x), rounds),
                     "float": _time(functools.partial(table.linear, x, dense), rounds)}
            if cpu_linear.amx_runs():  # the AMX kernels' switch rows come from these columns
                times["c_tile_loop"] = _time(functools.partial(_amx_from, kernel, 0, x), rounds)
                times["c_amx"] = _time(functools.partial(_amx_from, kernel, 1, x), rounds)
            if codes.bits == 4 and cpu_linear.amx_runs():
                times["c_decoded_whole"] = _time(decoding_whole(
                    functools.partial(kernel.linear, x)), rounds)
            out[shape][str(rows)] = {side: round(t, 1) for side, t in times.items()}
    return out


def _amx_from(kernel, rows: int, x: torch.Tensor) -> torch.Tensor:
    """The kernel's linear with its AMX kernel from `rows` rows (0: never, the int4 / int8 tile
    loop; 1: at every row count)."""
    kept, kernel.matmul_rows = kernel.matmul_rows, rows
    try:
        return kernel.linear(x)
    finally:
        kernel.matmul_rows = kept


def _codes(kernel) -> quant.QuantizedWeight:
    """A kernel's weight back as a QuantizedWeight (codes unpacked, scales as it holds them)."""
    tiles = kernel.codes.shape[0]
    if isinstance(kernel, cpu_quant.Int8Linear):
        codes = kernel.codes.view(tiles, -1, 16, 2).permute(0, 2, 1, 3).reshape(tiles * 16, -1)
        return quant.QuantizedWeight(codes.contiguous(), kernel.scales.float()[:, None], None, 8,
                                     kernel.padded_in, kernel.padded_in)
    doubles = kernel.codes.shape[1]
    nibbles = torch.stack((kernel.codes & 15, kernel.codes >> 4), dim=2)  # [t, d, pair, 32]
    codes = nibbles.view(tiles, doubles, 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(tiles * 16, -1)
    groups = kernel.scales.shape[1]
    per_row = lambda v: v.permute(0, 2, 1).reshape(tiles * 16, groups).float()  # noqa: E731
    return quant.QuantizedWeight(quant.pack_nibbles(codes), per_row(kernel.scales),
                                 per_row(kernel.mins), 4, kernel.group_size, kernel.in_features)


def _time(fn, rounds: int) -> float:
    return median_call_us(fn, max(rounds, 5) * 4)


def _summary(step_ms: dict) -> dict:
    ratios = {"c_over_pytorch_int4": ("pytorch_int4", "c_int4"),
              "c_over_float": ("float", "c_int4")}
    if "c_int4_tile_loops" in step_ms:
        ratios["amx_over_tile_loops"] = ("c_int4_tile_loops", "c_int4")
        ratios["amx_over_decoded_whole"] = ("c_int4_decoded_whole", "c_int4")
    return step_summary(step_ms, ratios)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="decode steps per engine per round")
    p.add_argument("--prefill-prompts", type=int, default=16)
    p.add_argument("--linears-only", action="store_true", help="only the per-layer timings")
    args = p.parse_args()
    llms = engines()
    dtype = getattr(torch, llms["float"].dtype)
    if args.linears_only:
        print(json.dumps({"benchmark": "cpu_int4", "machine": machine(),
                          "float_dtype": str(dtype).removeprefix("torch."),
                          "layer_linears_us": layer_linears(llms["c_int4"], args.rounds, dtype)},
                         indent=1))
        return
    result = {"benchmark": "cpu_int4", "machine": machine(),
              "float_dtype": str(dtype).removeprefix("torch."),
              "baselines": "PyTorch's int4 op on the same Q4_1 codes; the default float weights "
                           "(float_dtype); same process, alternating",
              "decode": {str(b): decode_steps(llms, b, args.rounds, args.steps)
                         for b in args.batch},
              "prefill": {str(args.prefill_prompts): prefill_steps(
                  llms, args.prefill_prompts, max(2, args.rounds // 3))},
              "layer_linears_us": layer_linears(llms["c_int4"], args.rounds, dtype)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
