"""Discrete-event simulation of continuous batching on one replica, and goodput search."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.workload import Workload, requests

# time(prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens, sampled) -> seconds
StepTime = Callable[[float, float, int, float, int], float]


@dataclass(frozen=True)
class Replica:
    """What the simulator needs of a replica: its step time and its batching limits."""

    step: StepTime
    max_seqs: int
    max_batched_tokens: int
    kv_tokens: int
    tokens_per_step: float = 1.0
    prefix_hit: float = 0.0

    def __post_init__(self) -> None:
        if self.max_seqs < 1 or self.max_batched_tokens < 1 or self.kv_tokens < 1:
            raise ValueError("max_seqs, max_batched_tokens and kv_tokens must be at least 1")
        if self.tokens_per_step < 1.0:
            raise ValueError("tokens_per_step must be at least 1")


@dataclass(frozen=True)
class SimResult:
    """Per-request latencies (seconds) and the replica set's output throughput."""

    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    throughput_tok_s: float
    preemptions: int
    rejected: int
    # Output tokens over the first arrival to the last finish, every request counted: what a
    # load generator measures of a finite run (vLLM bench serve, servescope loadtest), where
    # throughput_tok_s is the steady state's.
    run_throughput_tok_s: float = math.nan

    def summary(self, metric: str) -> dict[str, float]:
        """mean / p50 / p95 / p99 of one metric in milliseconds."""
        values = getattr(self, metric) * 1e3
        if values.size == 0:
            return {"mean": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan}
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        return {"mean": float(values.mean()), "p50": float(p50), "p95": float(p95),
                "p99": float(p99)}


class _State:
    """Mutable per-request arrays of one simulation run."""

    def __init__(self, arrivals: np.ndarray, inputs: np.ndarray, outputs: np.ndarray,
                 hit: float, precomputed: np.ndarray | None = None) -> None:
        n = len(arrivals)
        self.arrival = arrivals.astype(float)
        self.prompt = inputs.astype(float)
        self.out = outputs.astype(float)
        self.computed = np.floor(inputs * hit)  # prefix-cache hits need no prefill
        if precomputed is not None:  # prompt tokens whose KV cache arrives from elsewhere
            self.computed = np.maximum(self.computed, np.asarray(precomputed, dtype=float))
        self.gen = np.zeros(n)
        self.reserved = np.zeros(n)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)


def _admit(s: _State, r: Replica, waiting: deque, running: list, kv_used: float,
           budget: float) -> float:
    """Move waiting requests into the batch while sequences, KV and the token budget allow."""
    while waiting and len(running) < r.max_seqs and budget > 0:
        i = waiting[0]
        need = s.prompt[i] + 1
        if kv_used + need > r.kv_tokens:
            break
        waiting.popleft()
        running.append(i)
        s.reserved[i] = need
        kv_used += need
        budget -= s.prompt[i] - s.computed[i]
    return kv_used


def _preempt(s: _State, running: list, waiting: deque, kv_used: float, grow: float,
             capacity: int) -> tuple[float, int]:
    """Recompute-preempt the newest sequences until one more decode step fits in the KV cache."""
    count = 0
    while running and kv_used + grow * len(running) > capacity and len(running) > 1:
        i = running.pop()
        kv_used -= s.reserved[i]
        s.prompt[i] += math.floor(s.gen[i])
        s.out[i] -= math.floor(s.gen[i])
        s.gen[i] -= math.floor(s.gen[i])
        s.computed[i] = 0.0
        waiting.appendleft(i)
        count += 1
    return kv_used, count


def _mixed_step(s: _State, r: Replica, running: list, t: float) -> tuple[float, list]:
    """One iteration with prefill chunks (decodes first, then prompts in admission order)."""
    budget = float(r.max_batched_tokens)
    decodes = [i for i in running if s.computed[i] >= s.prompt[i]]
    budget -= len(decodes) * r.tokens_per_step
    chunk_tokens, attn, sampled, done = 0.0, 0.0, len(decodes), []
    for i in running:
        left = s.prompt[i] - s.computed[i]
        if left <= 0 or budget <= 0:
            continue
        c = min(left, budget)
        attn += c * (s.computed[i] + c / 2.0)
        chunk_tokens += c
        budget -= c
        s.computed[i] += c
        if c == left:
            done.append(i)
            sampled += 1
    ctx = float(sum(s.prompt[i] + s.gen[i] for i in decodes))
    t += r.step(chunk_tokens, attn, len(decodes), ctx, sampled)
    for i in decodes:
        s.gen[i] += r.tokens_per_step
        s.reserved[i] += r.tokens_per_step
    for i in done:
        s.gen[i] += 1.0
        if math.isnan(s.first[i]):
            s.first[i] = t
    return t, decodes


def _decode_run(s: _State, r: Replica, running: list, t: float, horizon: float,
                kv_used: float) -> tuple[float, int]:
    """Several decode-only iterations at once, up to the first finish, arrival or full cache:
    the batch does not change in between, and step time grows linearly with the context."""
    idx = np.fromiter(running, dtype=np.int64)
    e = r.tokens_per_step
    left = s.out[idx] - s.gen[idx]
    k = max(1, math.ceil(float(left.min()) / e))
    k = min(k, max(1, int((r.kv_tokens - kv_used) // (e * len(idx)))))
    ctx0 = float((s.prompt[idx] + s.gen[idx]).sum())
    t0 = r.step(0, 0.0, len(idx), ctx0, len(idx))
    slope = r.step(0, 0.0, len(idx), ctx0 + e * len(idx), len(idx)) - t0 if k > 1 else 0.0
    if horizon < math.inf:
        k = min(k, _steps_until(horizon - t, t0, slope))
    s.gen[idx] += k * e
    s.reserved[idx] += k * e
    return t + k * t0 + slope * k * (k - 1) / 2.0, k


def _steps_until(dt: float, t0: float, slope: float) -> int:
    """Fewest steps whose total time t0·k + slope·k(k-1)/2 reaches dt (at least one)."""
    if dt <= 0:
        return 1
    if slope <= 1e-15:
        return max(1, math.ceil(dt / t0))
    a, b = slope / 2.0, t0 - slope / 2.0
    return max(1, math.ceil((-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)))


def _retire(s: _State, running: list, t: float) -> tuple[list, float]:
    keep, freed = [], 0.0
    for i in running:
        if s.gen[i] >= s.out[i] and s.computed[i] >= s.prompt[i]:
            s.finish[i] = t
            freed += s.reserved[i]
        else:
            keep.append(i)
    return keep, freed


def run_replica(r: Replica, arrivals: np.ndarray, inputs: np.ndarray, outputs: np.ndarray,
                closed_loop: int = 0,
                precomputed: np.ndarray | None = None,
                turnaround_s: float = 0.0, gap_s: float = 0.0) -> tuple[_State, int]:
    """Simulate one replica; with `closed_loop` > 0 each finish releases the next request,
    `turnaround_s` after the finish and `gap_s` after the one released before it in the same
    step (Workload.client_turnaround_s, client_gap_s).
    `precomputed` counts, per request, prompt tokens already in the KV cache when it arrives
    (a disaggregated decode replica receives them from the prefill pool)."""
    if closed_loop and gap_s:
        arrivals = np.asarray(arrivals, dtype=float).copy()
        head = min(closed_loop, len(arrivals))
        arrivals[:head] += gap_s * np.arange(head)
    s = _State(arrivals, inputs, outputs, r.prefix_hit, precomputed)
    order = deque(range(len(arrivals)))
    waiting: deque = deque()
    running: list = []
    t, kv_used, preemptions, finished = 0.0, 0.0, 0, 0
    released = closed_loop or len(arrivals)
    while finished < len(arrivals):
        while order and order[0] < released and s.arrival[order[0]] <= t:
            waiting.append(order.popleft())
        if not running and not waiting:
            if order[0] >= released:
                released += 1
                continue
            t = max(t, s.arrival[order[0]])
            continue
        kv_used = _admit(s, r, waiting, running, kv_used, r.max_batched_tokens)
        kv_used, n = _preempt(s, running, waiting, kv_used, r.tokens_per_step, r.kv_tokens)
        preemptions += n
        if any(s.computed[i] < s.prompt[i] for i in running):
            t, _ = _mixed_step(s, r, running, t)
        else:
            can_join = order and order[0] < released and len(running) < r.max_seqs
            horizon = s.arrival[order[0]] if can_join else math.inf
            t, _ = _decode_run(s, r, running, t, horizon, kv_used)
        running, _ = _retire(s, running, t)
        kv_used = float(s.reserved[running].sum()) if running else 0.0
        done_now = int(np.count_nonzero(~np.isnan(s.finish))) - finished
        finished += done_now
        if closed_loop:
            for gap, j in enumerate(range(released, min(released + done_now, len(arrivals)))):
                s.arrival[j] = t + turnaround_s + gap_s * gap
            released += done_now
    return s, preemptions


def simulate(r: Replica, w: Workload, replicas: int = 1) -> SimResult:
    """Latency percentiles and throughput for `replicas` identical replicas behind a
    round-robin router (every replica then sees the same traffic; replica 0 is simulated)."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    arrivals, inputs, outputs = requests(w)
    original_out = outputs.astype(float)
    take = slice(0, None, replicas)
    closed = 0
    if w.concurrency is not None:
        closed = max(1, math.ceil(w.concurrency / replicas))
    s, preemptions = run_replica(r, arrivals[take], inputs[take], outputs[take], closed,
                                 turnaround_s=w.client_turnaround_s, gap_s=w.client_gap_s)
    keep = np.arange(len(s.finish))
    if w.rate is not None:
        keep = keep[len(keep) // 10:]  # drop the warm-up tenth: it starts from an empty system
    first, finish, arrival = s.first[keep], s.finish[keep], s.arrival[keep]
    out = original_out[take][keep]
    tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
    span = float(s.finish.max())
    if w.rate is not None:
        # Steady state: tokens over the arrival span; overloaded: over the finish span.
        span = max(float(np.ptp(s.arrival)), float(np.ptp(s.finish)))
    tokens = float(original_out[take].sum())
    throughput = tokens / span * replicas if span > 0 else math.inf
    run_span = float(s.finish.max() - s.arrival.min())
    run = tokens / run_span * replicas if run_span > 0 else math.inf
    return SimResult(first - arrival, tpot, finish - arrival, throughput, preemptions, 0, run)
