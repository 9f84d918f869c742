"""Cost: $/hour with a spot share, $ per 1M tokens (all on output, and split into input and
output), and autoscaling over a daily profile."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.catalog import Gpu


@dataclass(frozen=True)
class CostOptions:
    """How GPUs are bought: the spot share of GPU-hours and the capacity spot interruptions cost."""

    spot_share: float = 0.0
    interruption_overhead: float = 0.1
    autoscale: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.spot_share <= 1.0:
            raise ValueError("spot_share must be in [0, 1]")
        if self.interruption_overhead < 0:
            raise ValueError("interruption_overhead must be non-negative")


def gpu_hour_price(gpu: Gpu, opts: CostOptions) -> float:
    """Blended $/GPU-hour: spot hours cost extra by the share of work redone after interruptions.
    GPUs without a spot offer are bought on demand whatever the share."""
    if gpu.spot is None or opts.spot_share == 0.0:
        return gpu.on_demand
    spot = gpu.spot * (1.0 + opts.interruption_overhead)
    return (1.0 - opts.spot_share) * gpu.on_demand + opts.spot_share * spot


def cost_per_hour(gpu: Gpu, gpus_per_replica: int, replicas: float, opts: CostOptions) -> float:
    return gpu_hour_price(gpu, opts) * gpus_per_replica * replicas


def cost_per_million(cost_hour: float, output_tok_s: float) -> float:
    """$ per 1M output tokens: (cost per hour) / (tokens per hour) · 1e6."""
    if output_tok_s <= 0:
        return math.inf
    return cost_hour / (output_tok_s * 3600.0) * 1e6


def split_per_million(cost_hour: float, input_share: float, input_tok_s: float,
                      output_tok_s: float) -> tuple[float, float]:
    """($ per 1M input tokens, $ per 1M output tokens): the hour's cost divided between prompts
    and generated tokens by `input_share` of the GPU time, each part over its own tokens (input
    tokens counted whole, prefix-cache hits included, as providers bill them)."""
    inp = cost_per_million(cost_hour * input_share, input_tok_s)
    out = cost_per_million(cost_hour * (1.0 - input_share), output_tok_s)
    return inp, out


def hourly_replicas(peak_replicas: int, rate: float, profile: tuple[float, ...],
                    per_replica_rate: float) -> list[int]:
    """Replicas for each hour of a daily profile of rate multipliers (autoscaling; at least one)."""
    if not profile:
        return [peak_replicas]
    return [max(1, math.ceil(rate * m / per_replica_rate - 1e-9)) for m in profile]


def autoscaled_cost(gpu: Gpu, gpus_per_replica: int, hours: list[int], opts: CostOptions) -> float:
    """Average $/hour over the day when replicas follow the hourly need."""
    return sum(cost_per_hour(gpu, gpus_per_replica, r, opts) for r in hours) / len(hours)
