"""Run a plan here: start the plan's server on this machine with the plan's settings, record it
with the monitor while the plan's workload drives it, and store the run with its deployment and
the plan's predictions, so plan -> run -> measure -> calibrate closes on one machine (issue #15
item 5; the planner's calibration reads such runs through planner.measured.from_runs).

Qt-free: `servescope plan run-here` calls it, and so can the Planner pane on a worker thread.
The server is `servescope serve` with the flags planner.export gives it.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

import httpx

from planner.export import NotServable, servescope_serve_args
from planner.search import Plan
from planner.workload import Workload

START_TIMEOUT_S = 300.0
MEASURED_HERE = "measured here"  # how engine/device_profile.py's catalog entries say so
SOURCE_NAME = "plan-run"
DEMO_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the catalog's demo model


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


def predicted_figures(ev) -> dict:
    """A planner Evaluation's figures, in the terms run_here measures."""
    ttft, tpot = ev.result.summary("ttft"), ev.result.summary("tpot")
    return {"throughput_tok_s": ev.result.throughput_tok_s, "ttft_p50_ms": ttft["p50"],
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
    command = server_command(run)
    log = Path(tempfile.mkstemp(prefix="servescope-plan-run-", suffix=".log")[1])
    progress(f"starting {shlex.join(as_typed(command))}")
    server = LocalServer(command, log).start()
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


def server_command(run: PlanRun) -> list[str]:
    """`servescope serve` on a free loopback port with the plan's flags."""
    check_device(run)
    try:
        # The model's whole context, not the one the plan was sized for: a chat template or a
        # tokenizer's BOS may add a token or two to the plan's prompt lengths.
        flags = servescope_serve_args(run.plan, sized_context=False)
    except NotServable as exc:
        raise PlanRunError(f"This plan cannot run here: {exc}.") from None
    if not Path(run.model_path).exists():
        raise PlanRunError(f"The model {run.model_path} does not exist: give the GGUF file or "
                           "folder of the plan's model.")
    return [sys.executable, "-m", "app.cli", "serve", "--model", run.model_path,
            "--host", "127.0.0.1", "--port", str(free_port()), *flags]


def as_typed(command: list[str]) -> list[str]:
    """The server command as a user types it (`servescope serve ...`)."""
    return ["servescope", *command[3:]]


def _measure(run: PlanRun, db, server: LocalServer, command: list[str],
             progress: Callable[[str], None]) -> dict:
    from monitor.loadgen import LoadSpec, ServerInfo, run_load, store_run
    from monitor.recording import Recording
    from monitor.remote import ServerConfig
    from monitor.ssh import server_source

    d, w = run.plan.deployment, run.workload
    recording = Recording([server_source(ServerConfig(SOURCE_NAME, server.url,
                                                      interval_s=0.5))])
    recording.attach_database(db)
    recording.start()
    try:
        spec = LoadSpec(url=server.url, model=server.model(), rate=w.rate,
                        concurrency=w.concurrency, requests=run.requests,
                        # The plan's lengths are in tokens: exactly those, of the server's own
                        # tokenizer (token-id prompts from its /tokenize).
                        input_len=w.input_len, input_unit="tokens", output_len=w.output_len,
                        seed=w.seed)
        result = run_load(spec, progress=lambda done, total: progress(f"{done}/{total} requests"))
    finally:
        recording.stop()
        recording.close()
    if result.summary["completed"] == 0:
        errors = result.summary.get("errors") or ["no answer"]
        raise PlanRunError(f"No request to the plan's server succeeded ({errors[0]}); its log "
                           f"is {server.log}.")
    info = ServerInfo(gpu=d.gpu.name, tp=d.tp, pp=d.pp, weights=d.weights, kv=d.kv,
                      engine="servescope")
    extra = {"plan": {"command": as_typed(command), "predicted": run.predicted or {}}}
    run_id = store_run(db, result, name=f"plan run: {d.model.name} on {d.gpu.name}",
                       server=info, extra=extra)
    return {"run_id": run_id, "measured": measured_figures(result.summary),
            "predicted": run.predicted or {}, "command": as_typed(command),
            "log": str(server.log),
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

    def __init__(self, command: list[str], log: Path) -> None:
        self.command, self.log = command, log
        self.url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        self.process: subprocess.Popen | None = None
        self.started_s = 0.0

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalServer:
        began = time.monotonic()
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
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
