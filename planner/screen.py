"""Analytic screening: steady-state batch, step time and latency estimates without simulation."""

from __future__ import annotations

import math

from planner.timing import StepCost
from planner.workload import Workload

FIXED_POINT_ROUNDS = 8


def steady_step(cost: StepCost, rate: float, w: Workload, b_max: int) -> tuple[float, float] | None:
    """(mean seconds between a sequence's tokens, sequences decoding) at `rate` requests/s on
    one replica; None when the replica cannot keep up. Prompts arrive in lumps: each takes
    its chunked prefill iterations (decodes ride along) and decode-only steps fill the rest of
    each second; the batch follows from Little's law (batch = rate x decode time)."""
    d = cost.d
    e = d.spec.tokens_per_step if d.spec else 1.0
    prompt = max(1.0, w.input_len * (1.0 - d.prefix_hit))
    n_chunks = math.ceil(prompt / d.max_batched_tokens)
    chunk = prompt / n_chunks
    ctx = w.input_len + w.output_len / 2.0
    batch, tpot = 1.0, cost.decode_seconds(1, ctx) / e
    last = 0
    for _ in range(FIXED_POINT_ROUNDS):
        b = max(1, round(batch))
        if b == last:
            break  # each round depends only on the rounded batch: a repeat is the fixed point
        last = b
        t_prefill = cost.time(chunk, chunk * (w.input_len - prompt + chunk / 2.0), b, b * ctx,
                              b + 1)
        busy = rate * n_chunks * t_prefill
        if busy >= 1.0:
            return None
        steps = rate * n_chunks + (1.0 - busy) / cost.decode_seconds(b, ctx)
        tpot = 1.0 / (e * steps)
        batch = rate * w.output_len * tpot
        if batch > b_max * 1.02:
            return None
    return tpot, batch


def estimate(cost: StepCost, rate: float, w: Workload,
             b_max: int) -> tuple[float, float, float] | None:
    """(TTFT s, TPOT s, batch) at the steady state: a prompt waits like an M/D/1 queue whose
    service is its own prefill, then pays about one token interval."""
    state = steady_step(cost, rate, w, b_max)
    if state is None:
        return None
    tpot, batch = state
    service = cost.prefill_seconds(w.input_len)
    rho = rate * service
    if rho >= 1.0:
        return None
    wait = rho * service / (2.0 * (1.0 - rho))
    return service + wait + tpot, tpot, batch


def capacity(cost: StepCost, w: Workload, b_max: int) -> float:
    """Highest rate (requests/s) one replica sustains, by bisection on the steady state, to
    within 1/2^8 of its doubling bracket. The upper end is returned: the search starts its
    replica count from rate / capacity and counts up, so erring high never skips the fewest."""
    lo, hi = 0.0, 1.0
    while steady_step(cost, hi, w, b_max) is not None and hi < 1e6:
        lo, hi = hi, hi * 2.0
    for _ in range(8):
        mid = (lo + hi) / 2.0
        if steady_step(cost, mid, w, b_max) is None:
            hi = mid
        else:
            lo = mid
    return hi



def input_time_share(cost: StepCost, w: Workload, batch: float) -> float:
    """The share of a replica's GPU time that its requests' prompts take at a steady batch of
    `batch` decoding sequences, by marginal cost: a prompt costs what its chunked-prefill
    iterations take beyond the decode-only iterations they replace, a generated token its
    decode iteration divided among the sequences it serves (as steady_step counts them)."""
    d = cost.d
    e = d.spec.tokens_per_step if d.spec else 1.0
    b = max(1, round(batch))
    prompt = max(1.0, w.input_len * (1.0 - d.prefix_hit))
    n_chunks = math.ceil(prompt / d.max_batched_tokens)
    chunk = prompt / n_chunks
    ctx = w.input_len + w.output_len / 2.0
    decode_step = cost.decode_seconds(b, ctx)
    with_prompt = cost.time(chunk, chunk * (w.input_len - prompt + chunk / 2.0), b, b * ctx,
                            b + 1)
    prefill = n_chunks * max(with_prompt - decode_step, 0.0)
    decode = w.output_len * decode_step / (b * e)
    return prefill / (prefill + decode) if prefill + decode > 0 else 0.0
