"""Run a plan here: start the plan's server on this machine with the plan's settings, record it
with the monitor while the plan's workload drives it, and store the run with its deployment and
the plan's predictions, so plan -> run -> measure -> calibrate closes on one machine (issue #15
item 5; the planner's calibration reads such runs through planner.measured.from_runs).

Qt-free: `servescope plan run-here` calls it, and so can the Planner pane on a worker thread.
The server is the one the plan exports: real vLLM with the plan's `vllm serve` flags where vLLM
is installed here (app/vllm_local.py finds it), else `servescope serve` with the same settings
(planner.export gives both); `engine=` picks one.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from app import vllm_local
from planner.export import NotServable, servescope_serve_args, vllm_command
from planner.search import Plan
from planner.workload import Workload

START_TIMEOUT_S = 300.0
MEASURED_HERE = "measured here"  # how engine/device_profile.py's catalog entries say so
SOURCE_NAME = "plan-run"
SCRAPE_S = 0.5  # how often the monitor reads the plan's server while it runs
DEMO_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the catalog's demo model
# Which server runs the plan: vLLM where installed ("auto"), or the one named.
ENGINES = ("auto", "vllm", "servescope")


class PlanRunError(RuntimeError):
    """Why a plan could not be run here, in one sentence."""


@dataclass(frozen=True)
class PlanRun:
    """A plan, the workload it was sized for, and how much of it to send."""

    plan: Plan
    workload: Workload
    model_path: str  # the GGUF file or folder the server loads
    requests: int = 20
    predicted: dict | None = None  # the plan's own figures, stored beside the measured ones
    engine: str = "auto"  # one of ENGINES
    server_args: tuple[str, ...] = ()  # more flags for the server, after the plan's


@dataclass(frozen=True)
class ServerCommand:
    """How the plan's server starts here."""

    argv: list[str]
    typed: list[str]  # the command as a user types it (`vllm serve ...`, `servescope serve ...`)
    engine: str  # "servescope" or "vLLM <version>", stored with the run
    env: dict[str, str]


def likely_engine(engine: str) -> str:
    """The engine a run with `engine` ("auto" too) will be served by: vLLM wherever it is
    installed under "auto" (server_command may still fall back to servescope for a plan vLLM
    cannot run here)."""
    if engine != "auto":
        return engine
    return "vllm" if vllm_local.vllm_python() else "servescope"


def for_engine(deployment, engine: str):
    """The deployment timed as that engine runs it (the planner uses the engine's own step
    costs where `servescope plan machine` measured them: Gpu.engines)."""
    return replace(deployment, engine=likely_engine(engine))


# The load generator as a closed loop's client on the server's own machine: a finished
# request's successor reaches the engine some milliseconds later (reply read, request sent,
# tokenized), and the requests released together a millisecond or so apart. With fixed lengths
# real vLLM 0.32 here then ran concurrency 4 as one request ahead of three, every round (TTFT
# 119-144 ms against 303-398 ms): predicted in lockstep, TTFT p99 was its p50. The figures are
# not fitted: the predictions of benchmarks/planner_vs_real.py's stored vLLM runs moved by at
# most 3 points of median error for turnarounds of 2-20 ms and gaps of 0.5-2 ms.
LOADGEN_TURNAROUND_S = 0.005
LOADGEN_GAP_S = 0.001


def run_workload(workload, requests: int):
    """The plan's workload as run_here drives it: exactly `requests` requests, sent by the load
    generator (its closed loop's timing above). A prediction for the plan's own count would
    queue far more requests than are sent where the rate overloads the server (a 16-request
    run predicted as 200: TTFT 20-40x too long)."""
    return replace(workload, num_requests=requests, client_turnaround_s=LOADGEN_TURNAROUND_S,
                   client_gap_s=LOADGEN_GAP_S)


def predicted_figures(ev) -> dict:
    """A planner Evaluation's figures, in the terms run_here measures: throughput over the
    run's whole span, as the load generator divides it."""
    ttft, tpot = ev.result.summary("ttft"), ev.result.summary("tpot")
    return {"throughput_tok_s": ev.result.run_throughput_tok_s, "ttft_p50_ms": ttft["p50"],
            "ttft_p99_ms": ttft["p99"], "tpot_p50_ms": tpot["p50"], "tpot_p99_ms": tpot["p99"],
            "calibration": ev.calibration}


def demo_model_path(model) -> str:
    """The demo model's GGUF for a plan of the demo model (fetched on first use); a plan of any
    other model needs its own files."""
    from engine.models import DEMO_MODEL, fetch_demo_model

    if model.hf_id != DEMO_HF_ID:
        raise PlanRunError(f"{model.name} is not the demo model: give --model-path, the "
                           f"model's GGUF file or folder (the app serves {DEMO_MODEL} without "
                           "one).")
    return str(fetch_demo_model(progress=lambda message, fraction: None))


def run_here(run: PlanRun, db, progress: Callable[[str], None] = lambda message: None) -> dict:
    """Start the server, drive the load while recording /metrics into `db`, store the run;
    returns the measured and predicted figures with the run's id. PlanRunError says why not."""
    command = server_command(run, progress)
    log = Path(tempfile.mkstemp(prefix="servescope-plan-run-", suffix=".log")[1])
    progress(f"starting {shlex.join(command.typed)}")
    server = LocalServer(command.argv, log, command.env).start()
    try:
        progress(f"server up at {server.url} in {server.started_s:.0f} s; sending the load")
        return _measure(run, db, server, command, progress)
    finally:
        server.stop()


def check_device(run: PlanRun) -> None:
    """The plan must be for this machine (what `servescope plan machine` measured) or for the
    CUDA GPU it has: a run stored under another device's name would mis-calibrate it."""
    gpu = run.plan.deployment.gpu
    if gpu.source.startswith(MEASURED_HERE):
        return
    import torch

    from planner.catalog import load_catalog
    from planner.measured import match_gpu

    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if here is not None and match_gpu(here, load_catalog()) == gpu.name:
        return
    raise PlanRunError(f"This plan is for {gpu.name}, which this machine is not "
                       f"({here or 'no CUDA GPU'}): plan on --gpu 'this machine' (after "
                       "`servescope plan machine`) to run it here.")


def server_command(run: PlanRun, progress: Callable[[str], None] = lambda message: None
                   ) -> ServerCommand:
    """The plan's server on a free loopback port: vLLM or `servescope serve` (run.engine)."""
    if run.engine not in ENGINES:
        raise PlanRunError(f"Unknown engine {run.engine!r}: use one of {', '.join(ENGINES)}.")
    check_device(run)
    if not Path(run.model_path).exists():
        raise PlanRunError(f"The model {run.model_path} does not exist: give the GGUF file or "
                           "folder of the plan's model.")
    if run.engine == "servescope":
        return servescope_server(run)
    python = vllm_local.vllm_python()
    if run.engine == "vllm":
        if python is None:
            raise PlanRunError("No vLLM is installed here: set SERVESCOPE_VLLM_PYTHON to the "
                               "Python of an environment with vLLM, or run the plan with "
                               "servescope serve.")
        return vllm_server(run, python)
    if python is None:
        return servescope_server(run)
    try:
        return vllm_server(run, python)
    except PlanRunError as exc:  # vLLM here cannot run this plan: servescope serve may
        progress(f"{exc} Serving it with servescope serve instead.")
        return servescope_server(run)


def servescope_server(run: PlanRun) -> ServerCommand:
    """`servescope serve` with the plan's flags."""
    try:
        # The model's whole context, not the one the plan was sized for: a chat template or a
        # tokenizer's BOS may add a token or two to the plan's prompt lengths.
        flags = servescope_serve_args(run.plan, sized_context=False)
    except NotServable as exc:
        raise PlanRunError(f"This plan cannot run here: {exc}.") from None
    tail = ["--model", run.model_path, "--host", "127.0.0.1", "--port", str(free_port()),
            *flags, *run.server_args]
    return ServerCommand([sys.executable, "-m", "app.cli", "serve", *tail],
                         ["servescope", "serve", *tail], "servescope", dict(os.environ))


def vllm_server(run: PlanRun, python: str) -> ServerCommand:
    """Real vLLM's OpenAI server with the flags of the plan's exported `vllm serve` command."""
    problem = _vllm_cpu_problem(run.plan.deployment)
    if problem:
        raise PlanRunError(f"vLLM cannot run this plan here: {problem}.")
    try:
        version = vllm_local.version(python)
        exported = shlex.split(vllm_command(run.plan))
    except vllm_local.VllmUnavailable as exc:
        raise PlanRunError(str(exc)) from None
    except NotServable as exc:
        raise PlanRunError(f"vLLM cannot run this plan: {exc}.") from None
    # `vllm serve MODEL FLAGS...`: the model becomes a local folder; the context stays the
    # model's (as for servescope serve, above).
    flags = _without(exported[3:], "--max-model-len")
    model = _vllm_model(run, python)
    port, name, flags = free_port(), run.plan.deployment.model.hf_id, [*flags, *run.server_args]
    argv = vllm_local.server_command(python, model, port, name, flags)
    typed = ["vllm", "serve", model, *vllm_local.serve_flags(port, name, flags)]
    env = {**os.environ, **vllm_local.SERVER_ENV}
    if "VLLM_CPU_KVCACHE_SPACE" not in env and not _has_cuda():
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_gib(run.plan))
    return ServerCommand(argv, typed, f"vLLM {version}", env)


def cpu_kv_gib(plan) -> int:
    """The KV cache vLLM's CPU build reserves (VLLM_CPU_KVCACHE_SPACE, GiB) for the plan: what
    its batch needs at the model's whole context, within the plan's KV memory. vLLM's own
    default reserves 92% of the machine's memory and refuses to start where other processes
    hold more than 8% of it (seen: 21.2 of 23.5 GiB free)."""
    d, memory = plan.deployment, getattr(plan, "memory", None)
    per_token = getattr(memory, "kv_bytes_per_token", 0.0)
    needed = d.max_seqs * d.model.max_context * per_token / 2**30
    planned = getattr(memory, "kv_gb", 0.0) * 1e9 / 2**30
    return max(1, math.ceil(min(needed, planned) if planned > 0 else needed))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _vllm_cpu_problem(d) -> str:
    """What vLLM's CPU build cannot do of this deployment, on a machine without a CUDA GPU
    ('' where it can, or where there is a GPU: the export is then vLLM's own business)."""
    if _has_cuda():
        return ""
    if d.gpus > 1:
        return f"on this CPU it runs one instance, and the plan shards the model over {d.gpus}"
    if d.weights not in ("bf16", "fp16"):
        return f"its CPU build has no {d.weights} weights for {d.model.name} (plan with bf16)"
    if d.kv not in ("bf16", "fp16"):
        return f"its CPU build has no {d.kv} KV cache (plan with a bf16 one)"
    return ""


def _vllm_model(run: PlanRun, python: str) -> str:
    """The model as vLLM reads it: a Hugging Face folder (the demo GGUF converted once)."""
    path = Path(run.model_path)
    if path.is_dir():
        return str(path)
    if run.plan.deployment.model.hf_id == DEMO_HF_ID and path == Path(
            demo_model_path(run.plan.deployment.model)):
        try:
            return str(vllm_local.demo_folder(python)[0])
        except vllm_local.VllmUnavailable as exc:
            raise PlanRunError(str(exc)) from None
    raise PlanRunError(f"vLLM serves a Hugging Face folder, and {path} is a file: give the "
                       "model's folder, or run the plan with servescope serve.")


def _without(flags: list[str], name: str) -> list[str]:
    """The flags less `name` and its value."""
    if name not in flags:
        return flags
    i = flags.index(name)
    return flags[:i] + flags[i + 2:]


def _measure(run: PlanRun, db, server: LocalServer, command: ServerCommand,
             progress: Callable[[str], None]) -> dict:
    from monitor.loadgen import LoadSpec, ServerInfo, run_load, store_run
    from monitor.recording import Recording
    from monitor.remote import ServerConfig
    from monitor.ssh import server_source

    d, w = run.plan.deployment, run.workload
    recording = Recording([server_source(ServerConfig(SOURCE_NAME, server.url,
                                                      interval_s=SCRAPE_S))])
    recording.attach_database(db)
    recording.start()
    try:
        spec = LoadSpec(url=server.url, model=server.model(), rate=w.rate,
                        concurrency=w.concurrency, requests=run.requests,
                        # The plan's lengths are in tokens: exactly those, of the server's own
                        # tokenizer (token-id prompts from its /tokenize).
                        input_len=w.input_len, input_unit="tokens", output_len=w.output_len,
                        seed=w.seed, warmups=1)
        result = run_load(spec, progress=lambda done, total: progress(f"{done}/{total} requests"))
        # Two more scrapes after the last reply: the stored counters then include the last
        # requests (seen without: 2 of 4 finished requests recorded).
        time.sleep(2 * SCRAPE_S)
    finally:
        recording.stop()
        recording.close()
    if result.summary["completed"] == 0:
        errors = result.summary.get("errors") or ["no answer"]
        raise PlanRunError(f"No request to the plan's server succeeded ({errors[0]}); its log "
                           f"is {server.log}.")
    info = ServerInfo(gpu=d.gpu.name, tp=d.tp, pp=d.pp, weights=d.weights, kv=d.kv,
                      engine=command.engine)
    extra = {"plan": {"command": command.typed, "predicted": run.predicted or {}}}
    run_id = store_run(db, result, name=f"plan run: {d.model.name} on {d.gpu.name}",
                       server=info, extra=extra)
    return {"run_id": run_id, "measured": measured_figures(result.summary),
            "predicted": run.predicted or {}, "command": command.typed,
            "engine": command.engine, "log": str(server.log),
            "source": SOURCE_NAME}


def measured_figures(summary: dict) -> dict:
    """The load test's exact figures in the planner's terms."""
    return {"throughput_tok_s": summary["output_tokens_per_s"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "completed": summary["completed"], "failed": summary["failed"]}


# The figures a run made here is compared on, with their labels in tables.
VALIDATION_FIGURES = (("throughput_tok_s", "throughput tok/s"), ("ttft_p50_ms", "TTFT p50 ms"),
                      ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
                      ("tpot_p99_ms", "TPOT p99 ms"))


@dataclass(frozen=True)
class ValidationRow:
    """One plan run here: what the planner predicted, what was measured, by how much it erred
    (absolute percentage error per figure), and the calibration the prediction used."""

    run_id: int
    name: str
    load: str
    calibration: str
    predicted: dict
    measured: dict

    def error_pct(self, figure: str) -> float | None:
        p, m = self.predicted.get(figure), self.measured.get(figure)
        if p is None or not m:
            return None
        return abs(p - m) / m * 100.0

    def text(self, figure: str) -> str:
        """"12.3 / 10.1 (22%)": predicted / measured (absolute percentage error)."""
        p, m, e = self.predicted.get(figure), self.measured.get(figure), self.error_pct(figure)
        if p is None or m is None:
            return "—"
        return f"{p:.3g} / {m:.3g}" + (f" ({e:.0f}%)" if e is not None else "")


def validation_rows(runs: list[dict]) -> list[ValidationRow]:
    """The stored runs "Run a plan here" made (storage.queries.list_runs rows whose config
    carries the plan's prediction), newest first as given."""
    rows = []
    for run in runs:
        config, summary = run.get("config") or {}, run.get("summary") or {}
        predicted = (config.get("plan") or {}).get("predicted") if isinstance(config, dict) \
            else None
        if not predicted or not summary.get("completed"):
            continue
        try:
            measured = measured_figures(summary)
        except (KeyError, TypeError):
            continue  # a run stored by an older version without these figures
        rows.append(ValidationRow(int(run["id"]), str(run.get("name") or ""), _load_text(config),
                                  str(predicted.get("calibration") or "uncalibrated"),
                                  predicted, measured))
    return rows


def _load_text(config: dict) -> str:
    """"1 req/s, concurrency 4; 24 -> 12 tokens" from a stored load test's config."""
    parts = []
    if config.get("rate"):
        parts.append(f"{config['rate']:g} req/s")
    if config.get("concurrency"):
        parts.append(f"concurrency {config['concurrency']}")
    lengths = f"{config.get('input_len', '?')} -> {config.get('output_len', '?')} tokens"
    return f"{', '.join(parts) or 'all at once'}; {lengths}"


def median_errors(rows: list[ValidationRow]) -> dict[str, float]:
    """Per figure, the median absolute percentage error over the runs that have it."""
    out = {}
    for figure, _ in VALIDATION_FIGURES:
        errors = [e for e in (r.error_pct(figure) for r in rows) if e is not None]
        if errors:
            out[figure] = statistics.median(errors)
    return out


def validation_table(rows: list[ValidationRow]) -> tuple[list[str], list[list[str]]]:
    """The runs as a table of text (header, rows), a last row of median errors: what the
    Planner pane's Validation tab and the report show alike."""
    header = ["Run", "Load", "Calibration"] + [label for _, label in VALIDATION_FIGURES]
    body = [[f"{r.run_id}: {r.name}", r.load, r.calibration]
            + [r.text(key) for key, _ in VALIDATION_FIGURES] for r in rows]
    if rows:
        medians = median_errors(rows)
        body.append(["median absolute error", f"{len(rows)} run(s)", ""]
                    + [f"{medians[k]:.0f}%" if k in medians else "—"
                       for k, _ in VALIDATION_FIGURES])
    return header, body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """An OpenAI-compatible server process on this machine's loopback, stopped with its
    children (its own session)."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.command, self.log, self.env = command, log, env
        self.url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        self.process: subprocess.Popen | None = None
        self.started_s = 0.0

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalServer:
        began = time.monotonic()
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        try:
            self._wait_healthy(began + timeout_s, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - began
        return self

    def _wait_healthy(self, deadline: float, timeout_s: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PlanRunError(f"The plan's server exited with status "
                                   f"{self.process.returncode} before serving: "
                                   f"{self.last_line()} (log: {self.log}).")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise PlanRunError(f"The plan's server did not answer within {timeout_s:g} s "
                           f"(log: {self.log}).")

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=5.0).json()["data"][0]["id"]

    def last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """End a server started in a session of its own, its children too (vLLM's engine core):
    SIGTERM, then SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
