"""`servescope plan machine`: this machine measured and added to the planner's catalog, so the
demo model can be planned here (issue #19 item 1); the user's own catalogs stay untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planner.catalog import CatalogError, load_catalog
from planner.evaluate import evaluate
from planner.export import vllm_command
from planner.search import SearchSpace, search
from planner.timing import Deployment, StepCost
from planner.workload import Slo, Workload

USER_GPUS = """# my own GPU, with a comment that must survive
[gpu."My GPU"]
memory_gb = 24
bandwidth_gbs = 900
tflops = { bf16 = 150 }
interconnect = "PCIe4"
link_gbs = 32
link_latency_us = 5.7
power_w = 300
source = "mine"
date = "2025-01-01"
"""


def servescope(config_dir, *args: str, timeout: float = 600,
               **env: str) -> subprocess.CompletedProcess:
    """The CLI with `config_dir` as its config folder and `env` set (SERVESCOPE_VLLM_PYTHON=)."""
    env = dict(os.environ, SERVESCOPE_CONFIG_DIR=str(config_dir), **env)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, demo_gguf):
    """`servescope plan machine --quick --json` run once, into a config folder that already
    holds the user's own gpus.toml."""
    config = tmp_path_factory.mktemp("config")
    (config / "catalogs").mkdir()
    (config / "catalogs" / "gpus.toml").write_text(USER_GPUS)
    done = servescope(config, "plan", "machine", "--quick", "--json")
    assert done.returncode == 0, done.stderr
    return config, json.loads(done.stdout)


def test_the_measured_figures_are_real_and_written_beside_the_users_catalog(measured):
    config, profile = measured
    assert profile["read_bandwidth_gbs"] > 0.1 and profile["matmul_tflops"]["bf16"] > 0.001
    step = profile["step"]
    assert step["decode_step_ms"] > step["weights_read_ms"] > 0
    assert step["matmul_ms"] > 0
    assert step["overhead_ms"] == pytest.approx(
        max(0.0, step["decode_step_ms"] - max(step["weights_read_ms"], step["matmul_ms"])),
        abs=0.01)
    assert (config / "catalogs" / "gpus.toml").read_text() == USER_GPUS
    catalog = load_catalog(config)
    here = catalog.gpu("this machine")
    assert here.name == profile["machine"]["processor"]
    assert catalog.gpu("My GPU").memory_gb == 24  # the user's entry is still there
    # Stored over the planner's default fractions, so an uncalibrated plan predicts the rate
    # measured.
    assert here.bandwidth_gbs * 0.8 == pytest.approx(profile["read_bandwidth_gbs"], rel=0.01)
    assert here.compute_tflops("bf16") * 0.5 == pytest.approx(
        profile["matmul_tflops"]["bf16"], rel=0.01)
    assert here.step_overhead_ms == step["overhead_ms"]


def test_the_demo_model_is_planned_here_and_its_batch_1_step_is_the_one_measured(measured):
    config, profile = measured
    catalog = load_catalog(config)
    demo = catalog.model("SmolLM2-135M-Instruct")
    d = Deployment(demo, catalog.gpu("local"), weights="bf16", kv="bf16", max_seqs=16)
    # One decode at a short context: the overhead plus the longer of reading the weights and
    # multiplying by them (the latter on a CPU without bfloat16 instructions), as measured (the
    # KV read and the LM head's FLOPs add a little on top).
    predicted_ms = StepCost(d).decode_seconds(1, 32) * 1e3
    assert profile["step"]["decode_step_ms"] * 0.98 <= predicted_ms
    assert predicted_ms <= profile["step"]["decode_step_ms"] * 1.3
    w = Workload(64, 64, concurrency=4, num_requests=40)
    ev = evaluate(d, w)
    tpot = ev.result.summary("tpot")
    assert ev.memory.fits and ev.result.throughput_tok_s > 0
    assert tpot["p99"] >= tpot["p50"] >= predicted_ms * 0.9


def test_a_search_here_gives_plans_with_commands(measured):
    config, profile = measured
    catalog = load_catalog(config)
    w = Workload(64, 64, rate=0.2, slo=Slo(ttft_p99_ms=60_000, tpot_p99_ms=5_000),
                 num_requests=40)
    result = search(catalog.model("smollm2"), w, catalog,
                    SearchSpace(gpus=(catalog.gpu("this machine").name,), tp=(1,), pp=(1,),
                                weights=("bf16",), kv=("bf16",), max_seqs=(4, 16),
                                spec=(None,)))
    assert result.candidates
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in vllm_command(result.candidates[0])


def test_a_corrupt_machine_file_is_one_error_naming_it(tmp_path):
    (tmp_path / "catalogs").mkdir()
    bad = tmp_path / "catalogs" / "machine.toml"
    bad.write_text('[gpu."x"]\nmemory_gb = = 3\n')
    with pytest.raises(CatalogError, match="machine.toml"):
        load_catalog(tmp_path)
