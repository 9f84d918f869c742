"""`servescope plan run-here`: a plan for this machine predicted, served by a real `servescope
serve` with the plan's settings, loaded, recorded and stored beside its prediction; the stored
run then calibrates the planner (issue #15 item 5). Every refusal is one sentence."""

from __future__ import annotations

import json
import sys

import pytest
import sqlalchemy as sa

from planner.catalog import load_catalog
from planner.measured import from_runs
from storage.db import open_database
from storage.queries import list_runs
from tests.planner.test_machine_profile import servescope

LOAD = ["--input-len", "24", "--output-len", "12", "--requests", "4"]


@pytest.fixture(scope="module")
def config(tmp_path_factory, demo_gguf):
    """A config folder where `servescope plan machine` measured this machine."""
    folder = tmp_path_factory.mktemp("config")
    done = servescope(folder, "plan", "machine", "--quick", "--json")
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def ran(config, tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'runs.db'}"
    done = servescope(config, "plan", "run-here", "--model", "smollm2", "--concurrency", "2",
                      "--max-seqs", "4", "--weights", "int8", *LOAD, "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    return db, json.loads(done.stdout)


def test_the_plan_runs_and_is_stored_beside_its_prediction(ran):
    db_url, out = ran
    measured, predicted = out["measured"], out["predicted"]
    assert measured["completed"] == 4 and measured["failed"] == 0
    assert measured["throughput_tok_s"] > 0 and measured["tpot_p99_ms"] >= measured["tpot_p50_ms"]
    assert predicted["throughput_tok_s"] > 0 and predicted["calibration"]
    # The server ran with the plan's settings.
    command = out["command"]
    assert command[:3] == ["servescope", "serve", "--model"]
    assert command[command.index("--weights") + 1] == "int8"
    assert command[command.index("--max-num-seqs") + 1] == "4"
    db = open_database(db_url)
    try:
        [run] = list_runs(db)
        assert run["id"] == out["run_id"]
        assert run["config"]["plan"]["predicted"]["tpot_p50_ms"] == predicted["tpot_p50_ms"]
        assert run["config"]["engine"] == "servescope" and run["config"]["weights"] == "int8"
        assert run["summary"]["completed"] == 4
        # The monitor recorded the server's own series while the load ran.
        with db.engine.connect() as conn:
            samples = conn.execute(sa.text("SELECT count(*) FROM samples")).scalar()
        assert samples > 0
    finally:
        db.close()


def calibration_points(db_url: str, config):
    """The stored runs as the planner's calibration reads them: (points, skipped, catalog)."""
    db = open_database(db_url)
    try:
        runs = list_runs(db)
    finally:
        db.close()
    catalog = load_catalog(config)
    return *from_runs(runs, catalog), catalog


def test_the_stored_run_calibrates_the_planner_on_this_machine(ran, config):
    db_url, out = ran
    points, skipped, catalog = calibration_points(db_url, config)
    assert skipped == []
    [point] = points
    assert point.model == "SmolLM2-135M" and point.gpu == catalog.gpu("this machine").name
    assert point.weights == "int8" and point.batch == 2
    assert point.throughput_tok_s == pytest.approx(out["measured"]["throughput_tok_s"])


@pytest.mark.parametrize("flags,needle", [
    (["--gpu", "H100 SXM"], "This plan is for H100 SXM, which this machine is not"),
    (["--tp", "2"], "servescope serve runs on one device"),
    (["--weights", "fp8"], "servescope serve has no fp8 weights"),
    (["--model", "Llama-3.1-8B"], "Llama-3.1-8B is not the demo model: give --model-path"),
    (["--model-path", "/nonexistent/model.gguf"], "The model /nonexistent/model.gguf does not "
                                                  "exist"),
])
def test_a_plan_that_cannot_run_here_is_one_sentence(config, tmp_path, flags, needle):
    args = ["plan", "run-here", "--model", "smollm2", "--concurrency", "1", *LOAD,
            "--db", f"sqlite:///{tmp_path / 'x.db'}"]
    for flag in flags:  # a later --model wins over the default one
        args.append(flag)
    done = servescope(config, *args)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_a_server_that_cannot_start_says_so_and_names_its_log(config, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    done = servescope(config, "plan", "run-here", "--model", "smollm2", "--concurrency", "1",
                      *LOAD, "--model-path", str(bad), "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "The plan's server exited with status" in done.stderr and ".log" in done.stderr


def _run_here_with(config, tmp_path, vllm_python: str, *flags: str):
    """`plan run-here` with SERVESCOPE_VLLM_PYTHON set to `vllm_python`."""
    return servescope(config, "plan", "run-here", "--model", "smollm2", "--concurrency", "1",
                      *LOAD, "--db", f"sqlite:///{tmp_path / 'x.db'}", *flags,
                      SERVESCOPE_VLLM_PYTHON=vllm_python)


@pytest.mark.parametrize("python,flags,needle", [
    ("/nonexistent/bin/python", [], "The vLLM Python /nonexistent/bin/python does not exist"),
    # A Python without vLLM in it: the project's own.
    (sys.executable, [], f"vLLM does not import in {sys.executable}"),
    (sys.executable, ["--weights", "int8"],
     "vLLM cannot run this plan here: its CPU build has no int8 weights"),
])
def test_vllm_that_cannot_run_the_plan_is_one_sentence(config, tmp_path, python, flags, needle):
    done = _run_here_with(config, tmp_path, python, "--engine", "vllm", *flags)
    assert done.returncode == 2, done.stdout
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_auto_serves_with_servescope_where_vllm_here_cannot_and_says_why(config, tmp_path):
    # vLLM "installed" in a Python that cannot import it: auto says so and runs servescope.
    done = _run_here_with(config, tmp_path, sys.executable, "--engine", "auto")
    assert done.returncode == 0, done.stderr
    assert f"vLLM does not import in {sys.executable}" in done.stderr
    assert "Serving it with servescope serve instead." in done.stderr
    assert "served by servescope: servescope serve --model" in done.stdout
