"""The engine benchmark: prefill speed, TTFT, batch-1 decode and throughput under concurrency."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.sequence import SamplingParams

_TEXT = (
    "Large language models are served by engines that batch many requests together, keep the "
    "attention keys and values of every token in a paged cache, and schedule prefill and decode "
    "work so that the accelerator stays busy while each user still sees tokens arrive quickly. "
)

# The open-chat prompts the speculation, sampling and step benchmarks (benchmarks/) decode, one
# list so their figures stay comparable.
OPEN_CHAT = [
    "What are three tips for staying focused while studying?",
    "Explain what a GPU does in simple terms.",
    "Write a short poem about the ocean.",
    "What should I pack for a weekend hiking trip?",
]


@dataclass
class BenchEvent:
    """Progress of a running benchmark; the last event carries the result."""

    fraction: float
    message: str
    result: dict | None = None


def synthetic_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens (a rotated window over a fixed text)."""
    base = tokenizer.encode(_TEXT)
    pool = base * (length // len(base) + 2)
    return [pool[(i * 7) % len(base) :][:length] for i in range(count)]


def iter_benchmark(llm, *, quick: bool = False) -> Iterator[BenchEvent]:
    """Run the benchmark step by step; close the iterator to stop it early."""
    sizes = _sizes(quick)
    result: dict = {"model": llm.model_name, "device": str(llm.device), "dtype": llm.dtype,
                    "weights": llm.weights, "weight_bytes": llm.weight_bytes,
                    "kv_cache_dtype": llm.kv_cache_dtype, "quick": quick, "config": sizes,
                    # What the planner calibrates from it, in its names (planner/measured.py).
                    "precision": dict(zip(("weights", "kv"), llm.engine_config.precisions(
                        llm.device.type), strict=True))}
    yield BenchEvent(0.0, f"prefill of {sizes['prefill_tokens']} tokens")
    result.update(measure_prefill(llm, sizes["prefill_tokens"]))
    yield BenchEvent(0.2, f"batch-1 decode of {sizes['decode_tokens']} tokens")
    result["decode_tokens_per_s"] = measure_decode(llm, sizes["decode_tokens"])
    result["throughput_tokens_per_s"] = {}
    levels = sizes["concurrency"]
    for i, n in enumerate(levels):
        yield BenchEvent(0.3 + 0.7 * i / len(levels), f"{n} concurrent requests")
        result["throughput_tokens_per_s"][str(n)] = measure_throughput(
            llm, n, sizes["prompt_tokens"], sizes["new_tokens"])
    result["finished_at"] = time.time()
    # The machine (GPU names included) travels with the result: the planner calibrates from it.
    result["machine"] = machine()
    yield BenchEvent(1.0, "done", result)


def run_benchmark(llm, *, quick: bool = False, progress=None) -> dict:
    """Run the whole benchmark and return its result dict."""
    for event in iter_benchmark(llm, quick=quick):
        if progress is not None:
            progress(event)
        if event.result is not None:
            return event.result
    raise RuntimeError("the benchmark ended without a result")


def _sizes(quick: bool) -> dict:
    if quick:
        return {"prefill_tokens": 256, "decode_tokens": 32, "concurrency": [1, 4],
                "prompt_tokens": 32, "new_tokens": 16}
    return {"prefill_tokens": 1000, "decode_tokens": 128, "concurrency": [1, 4, 16, 64],
            "prompt_tokens": 64, "new_tokens": 64}


def measure_prefill(llm, tokens: int) -> dict:
    """TTFT and prefill tokens/s of one prompt of `tokens` tokens (median of three)."""
    prompt = synthetic_prompts(llm.tokenizer, 1, tokens)[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt[:16]], params)  # warm-up
    ttfts = sorted(llm.generate([prompt], params)[0].metrics.ttft_s for _ in range(3))
    ttft = ttfts[1]
    return {"prefill_tokens": tokens, "ttft_ms": ttft * 1000, "prefill_tokens_per_s": tokens / ttft}


def measure_decode(llm, tokens: int) -> float:
    """Batch-1 decode tokens/s: one request, `tokens` new tokens, greedy, EOS ignored."""
    prompt = synthetic_prompts(llm.tokenizer, 1, 16)[0]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    return 1.0 / out.metrics.tpot_s


def measure_throughput(llm, concurrency: int, prompt_tokens: int, new_tokens: int) -> float:
    """Generated tokens per second with `concurrency` requests submitted together."""
    prompts = synthetic_prompts(llm.tokenizer, concurrency, prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def alternating_decode_ms(llms: dict, prompts: list, rounds: int, steps: int) -> dict:
    """Decode step times (ms, one per round) of several engines holding the same requests
    (greedy, EOS ignored): each round runs one untimed step and `steps` timed ones of each engine
    in turn, so the machine's load falls on all alike. The requests are finished afterwards, so
    the engines come back empty."""
    # A request already prefilled decodes a token in each later prefill step of the others, so
    # each may make one token per prefill step before the rounds: room for those too.
    first = next(iter(llms.values()))
    prompt_tokens = sum(len(first.tokenizer.encode(p)) if isinstance(p, str) else len(p)
                        for p in prompts)
    prefill_steps = -(-prompt_tokens // first.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=rounds * (steps + 1) + 8 + prefill_steps,
                            ignore_eos=True)
    for llm in llms.values():
        for prompt in prompts:
            llm.add_request(prompt, params)
        # The prefill (long prompts take many chunked steps), then two warm decode steps.
        while llm.step()[1].num_prefill_tokens:
            pass
        llm.step()
    step_ms = {side: [] for side in llms}
    for _ in range(rounds):
        for side, llm in llms.items():
            llm.step()
            start = time.perf_counter()
            for _ in range(steps):
                llm.step()
            step_ms[side].append((time.perf_counter() - start) / steps * 1e3)
    for llm in llms.values():
        while llm.has_unfinished():
            llm.step()
    return step_ms


def alternating_prefill_ms(llms: dict, batches: list) -> dict:
    """The time (ms) each engine takes to prefill each batch of prompts (one new token each),
    engines in turn per batch; the first batch warms them up and is not counted."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    step_ms = {side: [] for side in llms}
    for i, batch in enumerate(batches):
        for side, llm in llms.items():
            for prompt in batch:
                llm.add_request(prompt, params)
            start = time.perf_counter()
            while llm.has_unfinished():
                llm.step()
            if i:
                step_ms[side].append((time.perf_counter() - start) * 1e3)
    return step_ms


def greedy_agreement(llms: dict, reference, chats: list[list[int]],
                     tokens: int = 48) -> tuple[dict, dict]:
    """Greedy replies of each engine (`llms`: side -> LLM) to the same chat prompts (token ids)
    against `reference`'s (an LLM, or the side of llms that is the reference): per side, how
    many are identical and the mean share of the reference's reply in common; and every side's
    replies (token ids), the reference's under "reference"."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    replies = {side: [o.token_ids for o in llm.generate(chats, params)]
               for side, llm in llms.items()}
    if isinstance(reference, str):
        want = replies.pop(reference)
    else:
        want = [o.token_ids for o in reference.generate(chats, params)]
    summary = {side: {"identical": sum(g == w for g, w in zip(got, want, strict=True)),
                      "of": len(chats),
                      "common_prefix": round(statistics.mean(
                          _common_prefix(g, w) / max(len(w), 1)
                          for g, w in zip(got, want, strict=True)), 3)}
               for side, got in replies.items()}
    return summary, {**replies, "reference": want}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def step_summary(step_ms: dict, ratios: dict[str, tuple[str, str]]) -> dict:
    """alternating_*_ms's times as a result: each engine's median, each named ratio (`name`:
    (slower side, faster side), the first's median over the second's), every round's times."""
    median = {side: statistics.median(v) for side, v in step_ms.items()}
    return {"step_ms": {side: round(m, 2) for side, m in median.items()},
            **{name: round(median[over] / median[under], 3)
               for name, (over, under) in ratios.items()},
            "rounds": {side: [round(x, 2) for x in v] for side, v in step_ms.items()}}


def timed_calls(fn, repeats: int) -> list[float]:
    """The seconds each of `repeats` calls of fn took, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_call_us(fn, repeats: int) -> float:
    """The median time (us) of `repeats` calls of fn after one warm-up call."""
    return statistics.median(timed_calls(fn, repeats)) * 1e6


def machine() -> dict:
    """A description of the machine a measurement ran on."""
    import os

    import torch

    info = {"platform": platform.platform(), "processor": _cpu_name(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def results_path() -> Path:
    """Where benchmark results are kept (`SERVESCOPE_DATA_DIR` overrides the data folder)."""
    import os

    from platformdirs import user_data_dir

    folder = os.environ.get("SERVESCOPE_DATA_DIR") or user_data_dir("servescope")
    return Path(folder) / "bench_results.jsonl"


def save_result(result: dict) -> Path:
    """Append a result to the local results file that the planner calibrates from."""
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")
    return path


def load_results() -> list[dict]:
    """Every saved result, oldest first; unreadable lines are skipped, never fatal."""
    path = results_path()
    if not path.is_file():
        return []
    results = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            results.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return results
