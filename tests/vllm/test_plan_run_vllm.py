"""Run a plan here on real vLLM: `servescope plan run-here --engine vllm` starts vLLM's own server
with the flags of the plan's exported `vllm serve` command, drives the plan's workload, records
vLLM's /metrics and stores the run under vLLM's name and version; the run then calibrates the
planner for this machine (issue #15 item 5, issue #19 item 1)."""

from __future__ import annotations

import json
import subprocess

import pytest
import sqlalchemy as sa

from engine.device_profile import fit_engine
from planner.catalog import load_catalog
from storage.db import open_database
from storage.queries import list_runs
from tests.planner.test_machine_profile import servescope as cli
from tests.test_plan_run import calibration_points
from tests.vllm.server import vllm_version

REQUESTS = 4
# eager mode skips torch.compile's warm-up (minutes on two cores; the test needs no speed).
LOAD = ["--input-len", "24", "--output-len", "12", "--requests", str(REQUESTS),
        "--server-arg=--enforce-eager"]
pytestmark = pytest.mark.xdist_group("vllm")  # after or before the session's vLLM, not beside


def servescope(config, python: str, *args: str) -> subprocess.CompletedProcess:
    return cli(config, *args, timeout=900, SERVESCOPE_VLLM_PYTHON=python)


@pytest.fixture(scope="module")
def ran(vllm_python, tmp_path_factory, demo_gguf):
    config = tmp_path_factory.mktemp("config")
    # vLLM's own steps timed as the run below serves them (eager), beside servescope's.
    done = servescope(config, vllm_python, "plan", "machine", "--quick", "--json", "--vllm",
                      "--vllm-eager")
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)
    db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'runs.db'}"
    done = servescope(config, vllm_python, "plan", "run-here", "--model", "smollm2",
                      "--concurrency", "2", "--max-seqs", "4", "--engine", "vllm", *LOAD,
                      "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    return config, db, json.loads(done.stdout), vllm_version(vllm_python), profile


def test_the_plan_runs_on_vllm_with_its_exported_flags(ran):
    _config, db_url, out, version, _profile = ran
    assert out["engine"] == f"vLLM {version}"
    command = out["command"]
    assert command[:2] == ["vllm", "serve"]
    assert command[command.index("--max-num-seqs") + 1] == "4"
    assert command[command.index("--tensor-parallel-size") + 1] == "1"
    assert "--enable-prefix-caching" in command and command[-1] == "--enforce-eager"
    measured = out["measured"]
    assert measured["completed"] == REQUESTS and measured["failed"] == 0
    assert measured["throughput_tok_s"] > 0 and measured["tpot_p99_ms"] >= measured["tpot_p50_ms"]
    db = open_database(db_url)
    try:
        [run] = list_runs(db)
        assert run["config"]["engine"] == f"vLLM {version}"
        assert run["config"]["plan"]["command"] == command
        with db.engine.connect() as conn:
            kind, stored_version = conn.execute(sa.text(
                "SELECT kind, version FROM sources WHERE name = 'plan-run'")).one()
            finished = conn.execute(sa.text(
                "SELECT max(s.value) FROM samples s JOIN series r ON s.series_id = r.id "
                "JOIN sources o ON r.source_id = o.id WHERE o.name = 'plan-run' "
                "AND r.name = 'requests_finished_total'")).scalar()
            recorded = conn.execute(sa.text("SELECT count(*) FROM requests WHERE run_id = :r"),
                                    {"r": run["id"]}).scalar()
        # The monitor read vLLM itself, and counted the load's requests as the client did, and
        # the warm-up request the client sends first and does not record.
        assert (kind, stored_version) == ("vllm", version)
        assert finished == REQUESTS + 1
        assert recorded == REQUESTS
    finally:
        db.close()


def test_the_vllm_run_calibrates_the_planner_on_this_machine(ran):
    config, db_url, out, version, _profile = ran
    [point], skipped, catalog = calibration_points(db_url, config)
    assert skipped == []
    assert point.gpu == catalog.gpu("this machine").name and point.engine == f"vLLM {version}"
    assert point.throughput_tok_s == pytest.approx(out["measured"]["throughput_tok_s"])


def test_vllm_s_own_steps_are_fitted_and_time_its_plans(ran):
    """`plan machine --vllm` times vLLM's offline engine and fits its costs beside servescope's;
    a run-here served by vLLM is predicted with vLLM's costs: its TPOT at concurrency 2 is no
    shorter than vLLM's own fastest timed step, whatever servescope's step is."""
    config, _db, out, version, profile = ran
    fitted = profile["engines"]["vllm"]
    timings = fitted["timings"]
    assert timings["engine"] == "vllm" and timings["version"] == version and timings["eager"]
    decode = {int(b): ms for b, ms in timings["decode_ms"].items()}
    # Every batch timed (not ordered: on a CPU with bfloat16 instructions vLLM's batch-1 and
    # batch-4 steps cost about the same, and a CI run timed batch 1 at 50.0 ms, 4 at 44.1).
    assert sorted(decode) == [1, 4, 8] and min(decode.values()) > 0
    assert timings["prefill_ms"] > 0
    assert fitted["tflops_bf16"] > 0 and fitted["overhead_ms"] >= 0
    # The stored costs are the fit of the stored timings (how well a line fits this run's
    # timings is the machine's business, not the test's: a threshold here failed on a noisy CI).
    assert fit_engine(timings, profile["shape"], profile["read_bandwidth_gbs"]) == fitted
    assert fitted["prefill_fit_error_pct"] >= 0
    # Stored in the machine's catalog entry, where every later plan reads it.
    here = load_catalog(config).gpu("this machine")
    assert set(here.engines) == {"servescope", "vllm"}
    assert here.engines["vllm"]["overhead_ms"] == pytest.approx(fitted["overhead_ms"])
    assert here.engines["vllm"]["per_seq_ms"] == pytest.approx(fitted["per_seq_ms"])
    tpot = out["predicted"]["tpot_p50_ms"]
    assert tpot >= min(decode.values()) * 0.9, (tpot, decode, profile["step"])
