"""Workloads: arrival process, length distributions, prefix share and latency SLOs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ARRIVALS = ("poisson", "gamma")
LENGTHS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class Slo:
    """Latency targets on the 99th percentile (milliseconds)."""

    ttft_p99_ms: float = float("inf")
    tpot_p99_ms: float = float("inf")

    def __post_init__(self) -> None:
        if self.ttft_p99_ms <= 0 or self.tpot_p99_ms <= 0:
            raise ValueError("SLO targets must be positive milliseconds")


@dataclass(frozen=True)
class Workload:
    """Traffic to serve: open-loop `rate` (requests/s), closed-loop `concurrency`, or `offline`."""

    input_len: int
    output_len: int
    rate: float | None = None
    concurrency: int | None = None
    offline: bool = False
    arrival: str = "poisson"
    cv: float = 1.0
    input_dist: str = "fixed"
    output_dist: str = "fixed"
    length_cv: float = 0.5
    prefix_share: float = 0.0
    slo: Slo = field(default_factory=Slo)
    num_requests: int = 600
    seed: int = 0
    daily_profile: tuple[float, ...] = ()
    # A closed loop's client, as the simulator sees it: the requests it releases together (the
    # run's start, or finishes in one step) reach the engine `client_gap_s` apart, each
    # `client_turnaround_s` after the finish that released it. An idle engine starts a step on
    # the first to arrive and the others wait for that step; a busy one has started its next
    # step before any arrives. 0 and 0: an ideal client, every release there at once (how the
    # published benchmarks' closed loops are predicted: planner/validation.py).
    client_turnaround_s: float = 0.0
    client_gap_s: float = 0.0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input and output lengths must be at least 1 token")
        modes = sum([self.rate is not None, self.concurrency is not None, self.offline])
        if modes != 1:
            raise ValueError("give exactly one of rate, concurrency or offline")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive requests per second")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}")
        if self.input_dist not in LENGTHS or self.output_dist not in LENGTHS:
            raise ValueError(f"length distributions must be one of {LENGTHS}")
        if self.cv <= 0 or self.length_cv < 0 or not 0.0 <= self.prefix_share < 1.0:
            raise ValueError("cv must be positive, length_cv non-negative, prefix_share in [0, 1)")
        if self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if self.client_turnaround_s < 0 or self.client_gap_s < 0:
            raise ValueError("client turnaround and gap must be non-negative seconds")
        if any(m < 0 for m in self.daily_profile):
            raise ValueError("daily_profile multipliers must be non-negative")

    @property
    def mode(self) -> str:
        if self.offline:
            return "offline"
        return "rate" if self.rate is not None else "concurrency"


def lengths(mean: int, dist: str, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n token lengths with the given mean: fixed, uniform on [0.5, 1.5]·mean, or lognormal."""
    if dist == "fixed" or cv == 0:
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        values = rng.uniform(0.5 * mean, 1.5 * mean, n)
    else:
        sigma = np.sqrt(np.log1p(cv * cv))
        values = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, n)
    return np.maximum(1, np.rint(values)).astype(np.int64)


def arrival_times(rate: float, arrival: str, cv: float, n: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Arrival instants: Poisson, or gamma inter-arrivals with coefficient of variation `cv`."""
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps)


def requests(w: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival s, input tokens, output tokens) for every request of the workload."""
    rng = np.random.default_rng(w.seed)
    inputs = lengths(w.input_len, w.input_dist, w.length_cv, w.num_requests, rng)
    outputs = lengths(w.output_len, w.output_dist, w.length_cv, w.num_requests, rng)
    if w.rate is not None:
        arrivals = arrival_times(w.rate, w.arrival, w.cv, w.num_requests, rng)
    else:
        arrivals = np.zeros(w.num_requests)
    return arrivals, inputs, outputs
