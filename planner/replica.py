"""One replica as the simulator sees it: the memory it plans for a workload and its step time.

Shared by evaluation, search, disaggregation, spot pools and the validation against published
points (which evaluation's report reads, so it cannot import evaluation itself)."""

from __future__ import annotations

from planner.calibrate import Calibration
from planner.memory import MemoryPlan, plan_memory
from planner.simulate import Replica
from planner.timing import Deployment, StepCost
from planner.workload import Workload


def max_context(w: Workload) -> int:
    """Longest request the KV cache must hold (uniform lengths reach 1.5x the mean)."""
    scale = {"fixed": 1.0, "uniform": 1.5, "lognormal": 3.0}
    return int(w.input_len * scale[w.input_dist] + w.output_len * scale[w.output_dist])


def memory_for(d: Deployment, w: Workload) -> MemoryPlan:
    return plan_memory(d.model, d.gpu, d.weights, d.kv, d.tp, d.pp, max_context(w),
                       d.max_batched_tokens, d.dcp)


def replica_for(d: Deployment, memory: MemoryPlan, calibration: Calibration) -> Replica:
    cost = StepCost(d, calibration.efficiency(d.gpu.name, d.weights))
    tokens = d.spec.tokens_per_step if d.spec else 1.0
    return Replica(cost.time, d.max_seqs, d.max_batched_tokens, memory.kv_tokens, tokens,
                   d.prefix_hit)
