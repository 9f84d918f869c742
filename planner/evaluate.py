"""Evaluate one deployment against a workload: memory fit, simulated latency, throughput, cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.calibrate import Calibration
from planner.cost import CostOptions, cost_per_hour, cost_per_million, split_per_million
from planner.memory import MemoryPlan
from planner.replica import memory_for, replica_for
from planner.screen import estimate, input_time_share
from planner.simulate import SimResult, simulate
from planner.timing import Deployment, StepCost
from planner.workload import Workload


class InfeasibleError(ValueError):
    """A plan that cannot run: the message says why and what to relax."""


@dataclass(frozen=True)
class Evaluation:
    """One deployment's predicted behaviour under a workload."""

    deployment: Deployment
    replicas: int
    memory: MemoryPlan
    result: SimResult
    cost_per_hour: float
    cost_per_1m_tokens: float
    calibration: str
    cost_per_1m_input: float = float("nan")  # split by GPU time (planner.screen)
    cost_per_1m_output: float = float("nan")


def check_context(model, w: Workload) -> None:
    """Refuse a workload whose requests (mean prompt plus reply) outrun the model's context: no
    server would accept them."""
    need = w.input_len + w.output_len
    if need > model.max_context:
        raise ValueError(f"{model.name} has a {model.max_context}-token context; the workload's "
                         f"requests need {need} tokens (input plus output): shorten the prompts "
                         f"or the replies")


def evaluate(d: Deployment, w: Workload, replicas: int = 1,
             calibration: Calibration | None = None,
             cost_opts: CostOptions | None = None) -> Evaluation:
    """Memory fit, then a simulation of `replicas` replicas; raises InfeasibleError if it
    cannot fit."""
    calibration = calibration or Calibration()
    check_context(d.model, w)
    memory = memory_for(d, w)
    if not memory.fits:
        raise InfeasibleError(f"{d.model.name} on {d.gpus}x {d.gpu.name} ({d.weights} weights, "
                              f"{d.layout}) does not fit: {memory.reason}")
    result = simulate(replica_for(d, memory, calibration), w, replicas)
    hourly = cost_per_hour(d.gpu, d.gpus, replicas, cost_opts or CostOptions())
    inp, out = token_prices(d, w, replicas, memory, calibration, hourly,
                            result.throughput_tok_s)
    return Evaluation(d, replicas, memory, result, hourly,
                      cost_per_million(hourly, result.throughput_tok_s), calibration.name,
                      inp, out)


def token_prices(d: Deployment, w: Workload, replicas: int, memory: MemoryPlan,
                 calibration: Calibration, hourly: float,
                 output_tok_s: float | None = None) -> tuple[float, float]:
    """($ per 1M input, $ per 1M output tokens) of `replicas` replicas serving `w`, split by the
    prompts' share of GPU time at the steady batch: closed-loop concurrency per replica, an open
    loop's steady state, else (offline, or no steady state) the batch limit. Tokens are counted
    at `w`'s rate, or at `output_tok_s` (a simulation's) where given."""
    cost = StepCost(d, calibration.efficiency(d.gpu.name, d.weights))
    b_max = min(d.max_seqs, memory.max_sequences)
    if output_tok_s is None:
        output_tok_s = (w.rate or 0.0) * w.output_len
    rate = output_tok_s / w.output_len if w.output_len else 0.0
    if w.concurrency is not None:
        batch = min(math.ceil(w.concurrency / replicas), b_max)
    else:
        state = estimate(cost, w.rate / replicas, w, memory.max_sequences) if w.rate else None
        batch = min(state[2], b_max) if state is not None else b_max
    share = input_time_share(cost, w, batch)
    return split_per_million(hourly, share, rate * w.input_len, output_tok_s)


def evaluation_dict(ev: Evaluation) -> dict:
    """The JSON shape of `servescope plan evaluate --json`."""
    d = ev.deployment
    return {
        "model": d.model.name, "gpu": d.gpu.name, "tp": d.tp, "pp": d.pp, "dcp": d.dcp, "cp": d.cp,
        "layout": d.layout, "gpus_per_replica": d.gpus,
        "replicas": ev.replicas, "weights": d.weights, "kv": d.kv, "max_seqs": d.max_seqs,
        "fits": ev.memory.fits,
        "memory_gb": round(ev.memory.total_gb, 3),
        "memory": {"weights": round(ev.memory.weights_gb, 3),
                      "activations": round(ev.memory.activations_gb, 3),
                      "reserve": round(ev.memory.reserve_gb, 3),
                      "kv_cache": round(ev.memory.kv_gb, 3),
                      "usable": round(ev.memory.usable_gb, 3),
                      "kv_tokens": ev.memory.kv_tokens},
        "throughput_tok_s": round(ev.result.throughput_tok_s, 2),
        "ttft_ms": _rounded(ev.result.summary("ttft")),
        "tpot_ms": _rounded(ev.result.summary("tpot")),
        "e2e_ms": _rounded(ev.result.summary("e2e")),
        "preemptions": ev.result.preemptions,
        "cost_per_hour": round(ev.cost_per_hour, 4),
        "cost_per_1m_tokens": round(ev.cost_per_1m_tokens, 4),
        "cost_per_1m_input_tokens": round(ev.cost_per_1m_input, 4),
        "cost_per_1m_output_tokens": round(ev.cost_per_1m_output, 4),
        "calibration": ev.calibration,
        "price_source": f"{d.gpu.price_source} ({d.gpu.price_date})",
        "basis": _basis(ev.calibration),
    }


def _basis(calibration: str) -> dict:
    from planner.validation import basis  # the validation set is read on first use only

    return basis(calibration)


def _rounded(summary: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in summary.items()}
