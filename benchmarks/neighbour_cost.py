"""What a neighbour's CPU time per token costs the engine's batch-1 decode, per precision.

A server's client and HTTP thread share the machine with the engine: each streamed token costs
them some CPU time (the load generator about 0.2 ms, `servescope serve`'s HTTP thread about 0.3
ms here), taken from the engine's OpenMP threads. This measures that price without a server:
the engine decodes one request at a time in this process (64-token replies, greedy,
ignore_eos), and after each step writes a byte to a pipe; a neighbour process reads it and
spins for `--burn-ms` of CPU time, as a client would on receiving the token. Each round runs the
engine without and then with the neighbour (order alternating by round), for each precision
(`--engines`, `servescope serve` flags). Prints one JSON object: the machine, per precision and
burn the median tok/s and the with/without ratio.

    .venv/bin/python benchmarks/neighbour_cost.py [--burn-ms 0.4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The neighbour: spins for the given milliseconds each time a byte arrives on its pipe.
NEIGHBOUR = r"""
import os, sys, time
burn, fd = float(sys.argv[1]) / 1e3, int(sys.argv[2])
while os.read(fd, 1):
    until = time.perf_counter() + burn
    while time.perf_counter() < until:
        pass  # spinning on purpose: its CPU time is what is measured
"""


def decode_tok_s(llm, prompt: str, params, neighbour_ms: float | None, requests: int) -> float:
    """Batch-1 output tok/s over `requests` requests, with a neighbour spinning
    `neighbour_ms` after every step (None: no neighbour)."""
    read, write = os.pipe()
    child = None
    if neighbour_ms is not None:
        child = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(neighbour_ms), str(read)],
                                 pass_fds=(read,))
        time.sleep(0.3)  # started and waiting on its pipe
    step = llm.step

    def step_and_wake():
        out = step()
        if child is not None:
            os.write(write, b"x")
        return out

    llm.step = step_and_wake
    try:
        start, tokens = time.perf_counter(), 0
        for _ in range(requests):
            tokens += len(llm.generate([prompt], params)[0].token_ids)
        return tokens / (time.perf_counter() - start)
    finally:
        llm.step = step
        os.close(write)
        os.close(read)
        if child is not None:
            child.wait()


def main() -> None:
    from engine import LLM, SamplingParams
    from engine.bench import machine
    from engine.engine_config import EngineConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=["--dtype bfloat16", "--weights int4"])
    p.add_argument("--burn-ms", type=float, nargs="+", default=[0.4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=3, help="requests per measurement")
    args = p.parse_args()
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    llms = {flags: LLM(EngineConfig.from_cli(parser.parse_args(shlex.split(flags))))
            for flags in args.engines}
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = "Tell me a story about a cat and a dog. " * 6
    for llm in llms.values():
        llm.generate([prompt], params)  # warm
    runs: dict = {flags: {str(b): [] for b in [None, *args.burn_ms]} for flags in llms}
    for i in range(args.rounds):
        for flags, llm in llms.items():
            burns = [None, *args.burn_ms]
            for burn in burns if i % 2 == 0 else burns[::-1]:
                runs[flags][str(burn)].append(decode_tok_s(llm, prompt, params, burn,
                                                           args.requests))
    result = {}
    for flags, by_burn in runs.items():
        quiet = by_burn["None"]
        result[flags] = {"tok_s_alone": statistics.median(quiet)} | {
            f"burn_{b}_ms": {"tok_s": statistics.median(v),
                             "over_alone": statistics.median(x / y for x, y in zip(v, quiet,
                                                                                    strict=True))}
            for b, v in by_burn.items() if b != "None"}
    print(json.dumps({"benchmark": "neighbour_cost", "machine": machine(),
                      "load": "batch 1, 64 new tokens, greedy, ignore_eos",
                      "results": result, "rounds": runs}, indent=1))


if __name__ == "__main__":
    main()
