"""Calibration: fit efficiency factors to measured runs and report the fit error."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner.catalog import Catalog, CatalogError, engine_key
from planner.timing import Deployment, Efficiency, StepCost


@dataclass(frozen=True)
class Calibration:
    """Efficiency factors per (GPU, weight precision), '*' matching any; plans cite its name."""

    name: str = "default (uncalibrated)"
    factors: dict[tuple[str, str], Efficiency] = field(default_factory=dict)
    fit_error_pct: float | None = None
    points: int = 0

    def efficiency(self, gpu: str, precision: str) -> Efficiency:
        for key in ((gpu, precision), (gpu, "*"), ("*", precision), ("*", "*")):
            if key in self.factors:
                return self.factors[key]
        return Efficiency()


@dataclass(frozen=True)
class Measurement:
    """A published or measured run: its configuration and what it achieved."""

    model: str
    gpu: str
    weights: str
    kv: str
    tp: int
    pp: int
    batch: int
    input_len: int
    output_len: int
    throughput_tok_s: float
    mode: str = "static"
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    source: str = ""
    engine: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("static", "continuous"):
            raise ValueError("mode must be 'static' or 'continuous'")
        if self.throughput_tok_s <= 0 or self.batch < 1:
            raise ValueError("throughput_tok_s must be positive and batch at least 1")


def predict(d: Deployment, m: Measurement, eff: Efficiency) -> dict[str, float]:
    """Closed-loop prediction at fixed batch: 'static' runs every prompt then decodes together
    (TensorRT-LLM's gptSessionBenchmark); 'continuous' staggers prompts among decodes."""
    cost = StepCost(d, eff)
    b, inp, out = m.batch, m.input_len, m.output_len
    if m.mode == "static":
        prefill = cost.time(b * inp, b * inp * inp / 2.0, 0, 0.0, b)
        # Decode time is linear in the context, so the mean context gives the exact sum.
        decode = (out - 1) * cost.decode_seconds(b, inp + out / 2.0)
        total = prefill + decode
        return {"throughput_tok_s": b * out / total, "tpot_ms": decode / max(out - 1, 1) * 1e3,
                "ttft_ms": prefill * 1e3}
    per_step_prefill = b * inp / out
    step = cost.time(per_step_prefill, per_step_prefill * inp / 2.0, b, b * (inp + out / 2.0),
                     b + b / out)
    return {"throughput_tok_s": b / step, "tpot_ms": step * 1e3,
            "ttft_ms": cost.prefill_seconds(inp) * 1e3 + step * 1e3}


def deployment_for(m: Measurement, catalog: Catalog) -> Deployment:
    return Deployment(catalog.model(m.model), catalog.gpu(m.gpu), m.weights, m.kv, m.tp, m.pp,
                      max_seqs=m.batch, max_batched_tokens=max(2048, m.input_len),
                      engine=engine_key(m.engine))


def ape(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured * 100.0


def point_error(predicted: dict[str, float], m: Measurement) -> float:
    """A point's error %: the mean of its throughput, TPOT and TTFT errors, over the figures the
    point measured. Throughput alone would leave the FLOPs factor free wherever decode never
    touches the compute roof (batch 1), and prefill, which does, is what TTFT measures."""
    errors = [ape(predicted["throughput_tok_s"], m.throughput_tok_s)]
    errors += [ape(predicted[key], measured) for key, measured in
               (("tpot_ms", m.tpot_ms), ("ttft_ms", m.ttft_ms)) if measured]
    return sum(errors) / len(errors)


def _grid_fit(measurements: list[Measurement], deployments: list[Deployment]
              ) -> tuple[float, Efficiency, list[float]]:
    """(median point error %, efficiency, per-point errors) of the best grid point.

    Ties on the median go to the lower mean: points that never touch the compute roof (decode
    at small batch, with no TTFT measured) fit any FLOPs factor, and the median alone would keep
    the first one tried."""
    best: tuple[float, Efficiency, list[float]] | None = None
    best_mean = 0.0
    for eff in _candidates(deployments):
        errors = [point_error(predict(d, m, eff), m)
                  for d, m in zip(deployments, measurements, strict=True)]
        score, mean = float(np.median(errors)), float(np.mean(errors))
        if best is None or (score, mean) < (best[0], best_mean):
            best, best_mean = (score, eff, errors), mean
    assert best is not None
    return best


def _candidates(deployments: list[Deployment]):
    """The efficiencies the fit tries. An engine whose own steps were timed on this device
    (Gpu.engines) is slowed or sped as a whole, one factor on its rate, its reads and its step
    costs alike: its batch scaling was measured, and a run or two at one batch cannot tell the
    three apart (a batch-1 run served 20% slower than the timed step was once fitted by memory
    0.2 and 5% of the step cost, which then mispriced every batch). Otherwise the full grid."""
    base = _measured_overhead(deployments)
    if base is not None and all(d.engine_costs for d in deployments):
        for k in ENGINE_SCALES:
            for serving in SERVING_PER_SEQ_MS:
                yield Efficiency(flops=DEFAULT.flops / k, memory=min(1.0, DEFAULT.memory / k),
                                 overhead_ms=round(base * k, 3),
                                 serving_ms_per_seq=float(serving))
        return
    # The step overheads to try: None (the device's own or the default) for catalog GPUs;
    # fractions of the measured one for a device measured here.
    overheads = tuple(round(base * f, 3) for f in OVERHEAD_FRACTIONS) if base else (None,)
    for flops in FLOPS_GRID:
        for memory in MEMORY_GRID:
            for overhead in overheads:
                yield Efficiency(flops=float(flops), memory=float(memory), overhead_ms=overhead)


def _measured_overhead(deployments: list[Deployment]) -> float | None:
    """The step overhead the deployments share as measured on their device (the engine's own
    where the device has it, else Gpu.step_overhead_ms; 0: none), or None if they differ."""
    measured = {d.measured_overhead_ms for d in deployments}
    return next(iter(measured)) if len(measured) == 1 else None


DEFAULT = Efficiency()
# Slowdowns tried for an engine timed here: served 2x faster to 4x slower than its timed steps.
ENGINE_SCALES = np.geomspace(0.5, 4.0, 61)
# And what serving adds per sequence per step on top (ms), the second thing a served run
# measures beside the timed steps: real vLLM served here at concurrency 4 decoded 7.5 ms a
# step slower than its offline engine at batch 4, and matched it at concurrency 1. Zero first,
# so a batch-1 run, which cannot tell it from the step's own cost, keeps none.
SERVING_PER_SEQ_MS = np.arange(0.0, 8.01, 0.25)


# The factors the fit tries. A GPU lands in 0.3-0.95 of its FLOPs and 0.5-0.95 of its bandwidth;
# a CPU serving in bfloat16 here fitted at both floors of that range with its steps still
# predicted short (served TPOT 38.8 ms against 32.8 at flops 0.3, memory 0.5), so the grid goes
# lower, where the fit then says how far a device is from its micro-benchmarked peaks.
FLOPS_GRID = np.arange(0.05, 0.951, 0.05)
MEMORY_GRID = np.arange(0.20, 0.951, 0.05)

# Fractions of a measured step overhead the fit tries: the micro-benchmark's single batch-1 step
# time is the figure most disturbed by other work on the machine, so runs may correct it.
OVERHEAD_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3, 1.6, 2.0)


def fit(measurements: list[Measurement], catalog: Catalog, name: str = "fitted") -> Calibration:
    """Grid-search one (FLOPs, memory, overhead) efficiency minimising the median point error
    (throughput, and TPOT and TTFT where measured)."""
    if not measurements:
        raise ValueError("calibration needs at least one measurement")
    deployments = [deployment_for(m, catalog) for m in measurements]
    score, eff, _ = _grid_fit(measurements, deployments)
    return Calibration(name, {("*", "*"): eff}, round(score, 2), len(measurements))


def fit_per_device(measurements: list[Measurement], catalog: Catalog,
                   name: str = "fitted") -> Calibration:
    """One efficiency pair per (GPU, weight precision) measured; other devices keep defaults.

    A factor fitted on one GPU says nothing honest about another, so nothing is pooled into '*'.
    The fit error is the median over every point, each judged by its own device's factor."""
    if not measurements:
        raise ValueError("calibration needs at least one measurement")
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.gpu, m.weights), []).append(m)
    factors, errors = {}, []
    for key, group in sorted(groups.items()):
        _, eff, group_errors = _grid_fit(group, [deployment_for(m, catalog) for m in group])
        factors[key] = eff
        errors += group_errors
    return Calibration(name, factors, round(float(np.median(errors)), 2), len(measurements))


def load_measurements(path: Path) -> list[Measurement]:
    """Measurements from a JSON file {"measurements": [...]}; errors name the file and field."""
    try:
        data: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path}: cannot read it as JSON ({exc})") from exc
    rows = data.get("measurements") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise CatalogError(f"{path}: field 'measurements' must be a list")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(Measurement(**{k: v for k, v in row.items() if k != "note"}))
        except (TypeError, ValueError) as exc:
            raise CatalogError(f"{path}: measurements[{i}]: {exc}") from exc
    return out
