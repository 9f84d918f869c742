"""Measured runs as calibration points: the local engine's benchmarks and stored load tests."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.calibrate import Calibration, Measurement, fit_per_device
from planner.catalog import KV_PRECISIONS, PRECISIONS, Catalog
from planner.memory import BYTES_PER_PARAM, KV_BYTES

# torch dtype names as engine.bench records them -> the planner's precisions.
DTYPES = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16",
          "torch.float16": "fp16", "bf16": "bf16", "fp16": "fp16"}
# CUDA device names that do not spell the catalog's name (HBM3 H100 boards are the SXM part).
GPU_ALIASES = {"h100": "H100 SXM", "h100 80gb hbm3": "H100 SXM"}
MODEL_SUFFIXES = ("-instruct", "-chat", "-hf")
# engine.quantize's weight formats (LLM.weights, recorded as a benchmark's "weights") -> the
# planner's precisions: "float" keeps the dtype; int8 per channel or in groups is int8; int4 in
# any group size is int4 (the planner prices int4 at groups of 128, the engine's default is 32:
# 0.53 against 0.5625 bytes a weight).
WEIGHT_FORMATS = {"int8": "int8", "int4": "int4"}
# engine.kv_options' KV-cache dtypes -> the planner's; "auto" (or none recorded) is the dtype.
KV_DTYPES = {"int8": "int8", "fp8": "fp8"}


@dataclass(frozen=True)
class CalibrationReport:
    """A fitted calibration, the points it used and why every other record was left out."""

    calibration: Calibration
    used: list[Measurement]
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        c = self.calibration
        text = f"{c.name}: {c.points} point(s), median throughput error {c.fit_error_pct:.1f}%"
        return text + (f"; {len(self.skipped)} record(s) skipped" if self.skipped else "")


def engine_results_path() -> Path:
    """engine.bench.results_path(), repeated here because engine/ may import torch."""
    folder = os.environ.get("SERVESCOPE_DATA_DIR")
    if not folder:
        from platformdirs import user_data_dir

        folder = user_data_dir("servescope")
    return Path(folder) / "bench_results.jsonl"


def load_engine_results(path: Path | None = None) -> list[dict[str, Any]]:
    """The engine's saved benchmark results, oldest first; unreadable lines are skipped."""
    path = path or engine_results_path()
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _tokens(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower())) - {""}


def match_gpu(device_name: str, catalog: Catalog) -> str | None:
    """The catalog GPU a CUDA device name denotes ("NVIDIA A100-SXM4-80GB" -> "A100 80GB")."""
    have = _tokens(device_name)
    found = [g for g in catalog.gpus if _tokens(g) <= have]
    if found:
        return max(found, key=lambda g: len(_tokens(g)))
    for alias, gpu in GPU_ALIASES.items():
        if _tokens(alias) <= have and gpu in catalog.gpus:
            return gpu
    return None


def match_model(name: str, catalog: Catalog) -> str | None:
    """The catalog model a served or Hugging Face name denotes (org/Llama-3.1-8B-Instruct)."""
    base = name.rsplit("/", 1)[-1].lower()
    for suffix in MODEL_SUFFIXES:
        base = base.removesuffix(suffix)
    return next((m for m in catalog.models if m.lower() in (name.lower(), base)), None)


def _engine_gpu(result: dict[str, Any]) -> str:
    gpus = (result.get("machine") or {}).get("gpus") or []
    return str(result.get("gpu") or (gpus[0] if gpus else ""))


def engine_precisions(result: dict[str, Any]) -> tuple[str | None, str | None]:
    """(weights, KV) precision of an engine result in the planner's names: as the engine
    recorded them (EngineConfig.precisions), or for a result recorded before it did, read from
    its dtype, weight format and KV-cache dtype (a test keeps the two readings equal)."""
    recorded = result.get("precision")
    if isinstance(recorded, dict):
        return recorded.get("weights"), recorded.get("kv")
    # An int4 benchmark moves a quarter of bf16's weight bytes: calibrated as bf16 it would
    # credit the GPU with four times the memory efficiency it has.
    dtype = DTYPES.get(str(result.get("dtype", "")))
    fmt = str(result.get("weights") or "float").strip().lower()
    weights = dtype if fmt == "float" else WEIGHT_FORMATS.get(fmt.split(":", 1)[0])
    kv_dtype = str(result.get("kv_cache_dtype") or "auto").strip().lower()
    return weights, dtype if kv_dtype == "auto" else KV_DTYPES.get(kv_dtype)


def _engine_target(result: dict[str, Any], catalog: Catalog
                   ) -> tuple[str, str, str, str] | str:
    """(model, GPU, weight precision, KV precision) of an engine result, or the reason it cannot
    calibrate."""
    device = str(result.get("device", ""))
    if not device.startswith("cuda"):
        return (f"engine result on {device or 'an unknown device'}: a CPU run says nothing "
                f"about a catalog GPU")
    gpu = match_gpu(_engine_gpu(result), catalog)
    if gpu is None:
        return f"engine result on {_engine_gpu(result) or device!r}: GPU not in the catalog"
    model = match_model(str(result.get("model", "")), catalog)
    if model is None:
        return f"engine result for {result.get('model')!r}: model not in the catalog"
    weights, kv = engine_precisions(result)
    if weights not in PRECISIONS:
        return (f"engine result with {result.get('dtype')!r} and weights "
                f"{result.get('weights')!r}: the planner models no such weight precision")
    if kv not in KV_PRECISIONS:
        return (f"engine result in {result.get('dtype')!r} with KV cache "
                f"{result.get('kv_cache_dtype')!r}: the planner models no such KV precision")
    return model, gpu, weights, kv


def from_engine(results: list[dict[str, Any]], catalog: Catalog
                ) -> tuple[list[Measurement], list[str]]:
    """Throughput at each concurrency of each usable result; reasons for the rest."""
    points, skipped = [], []
    for result in results:
        target = _engine_target(result, catalog)
        if isinstance(target, str):
            skipped.append(target)
            continue
        model, gpu, weights, kv = target
        sizes = result.get("config") or {}
        # Every request is submitted at once and decoded together: TensorRT's "static" shape.
        for level, tok_s in (result.get("throughput_tokens_per_s") or {}).items():
            points.append(Measurement(model, gpu, weights, kv, 1, 1, int(level),
                                      int(sizes.get("prompt_tokens", 64)),
                                      int(sizes.get("new_tokens", 64)), float(tok_s),
                                      source="engine benchmark", engine="servescope"))
    return points, skipped


def _run_point(run: dict[str, Any], catalog: Catalog) -> Measurement | str:
    config, summary = run.get("config") or {}, run.get("summary") or {}
    label = f"run {run.get('id', '?')} ({run.get('name') or run.get('kind', '')})"
    model = match_model(str(config.get("model") or ""), catalog)
    gpu = match_gpu(str(config.get("gpu") or ""), catalog) if config.get("gpu") else None
    weights = str(config.get("weights", "bf16"))
    kv = str(config.get("kv", weights))
    tok_s = summary.get("output_tokens_per_s")
    if model is None:
        return f"{label}: its configuration names no catalog model"
    if gpu is None:
        return f"{label}: its configuration names no catalog GPU"
    if weights not in BYTES_PER_PARAM or kv not in KV_BYTES or not tok_s:
        return f"{label}: unknown precision or no output throughput"
    batch = run_batch(config, summary, tok_s)
    if batch is None:
        return (f"{label}: an open-loop run without a measured TPOT, so its mean batch is "
                "unknown (a fixed-concurrency run gives it)")
    return Measurement(model, gpu, weights, kv, int(config.get("tp", 1)), int(config.get("pp", 1)),
                       batch, int(config.get("input_len", 128)),
                       int(config.get("output_len", 128)), float(tok_s), mode=run_mode(config),
                       tpot_ms=_median(summary, "tpot_ms"), ttft_ms=_median(summary, "ttft_ms"),
                       source=label, engine=str(config.get("engine", "")))


def run_mode(config: dict[str, Any]) -> str:
    """How a stored run is predicted when it calibrates. A closed loop of fixed lengths (a
    concurrency, no rate, no length spread or lengths file: what `plan run-here` and
    `planner_vs_real.py` send) starts its requests together and they finish together, so it
    runs as repeated static batches: every prompt prefilled at once, then decoded together,
    as the planner's simulator runs it too. Its prefill is not spread over the decode steps:
    where a prefill costs 30 decode steps (a CPU), spreading it doubled a batch-1 run's TPOT
    and the fit then traded the engine's speed against that error. Anything else is a
    continuous batch at its mean size."""
    fixed = not config.get("length_spread") and not config.get("lengths")
    return "static" if config.get("concurrency") and not config.get("rate") and fixed \
        else "continuous"


def _median(summary: dict[str, Any], key: str) -> float | None:
    """A run's p50 of `key` (what the planner's closed-loop prediction is judged against), None
    where the run has none."""
    value = (summary.get(key) or {}).get("p50")
    return float(value) if value else None


def run_batch(config: dict[str, Any], summary: dict[str, Any], tok_s: float) -> int | None:
    """The batch a run decoded at: its concurrency, or for an open-loop (rate) run the mean
    number of sequences decoding by Little's law, output tokens/s x mean TPOT; None without
    a TPOT."""
    if config.get("concurrency"):
        return int(config["concurrency"])
    tpot_ms = (summary.get("tpot_ms") or {}).get("mean")
    if not tpot_ms:
        return None
    return max(1, round(tok_s * tpot_ms / 1e3))


def from_runs(runs: list[dict[str, Any]], catalog: Catalog) -> tuple[list[Measurement], list[str]]:
    """Points from stored load tests (storage.queries.list_runs rows); reasons for the rest."""
    points, skipped = [], []
    for run in runs:
        point = _run_point(run, catalog)
        (skipped if isinstance(point, str) else points).append(point)
    return points, skipped


def calibrate_measured(engine_results: list[dict[str, Any]], runs: list[dict[str, Any]],
                       catalog: Catalog, name: str = "measured") -> CalibrationReport:
    """Fit per-device factors to every usable record; ValueError says why when none is usable."""
    engine_points, engine_skipped = from_engine(engine_results, catalog)
    run_points, run_skipped = from_runs(runs, catalog)
    points, skipped = engine_points + run_points, engine_skipped + run_skipped
    if not points:
        reasons = "; ".join(skipped[:3]) or "no engine benchmark results and no stored runs"
        raise ValueError(f"nothing to calibrate from: {reasons}")
    devices = sorted({f"{m.gpu} {m.weights}" for m in points})
    calibration = fit_per_device(points, catalog, f"{name} ({', '.join(devices)})")
    return CalibrationReport(calibration, points, skipped)
