"""`servescope plan machine`: this machine measured and added to the planner's catalog, so the
demo model can be planned here (issue #19 item 1); the user's own catalogs stay untouched."""

from __future__ import annotations

import dataclasses
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
    # Never faster than its weights' read: the bandwidth is at least the step's own.
    assert step["decode_step_ms"] >= step["weights_read_ms"] > 0
    assert profile["read_bandwidth_gbs"] >= profile["reduction_gbs"]
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


def test_servescope_s_own_steps_are_fitted_and_the_planner_gives_them_back(measured):
    """The engine's fitted rate and costs are the fit of its timed steps, and the planner's
    step model times them as the fit does: the prefill off by exactly the fit's own error, the
    decode steps on the fitted line. (Not the timings themselves within a bound: on a CPU
    whose batch-1 and batch-4 steps cost the same, noise orders them either way, and no line
    goes through both.)"""
    from engine.device_profile import fit_engine

    config, profile = measured
    fitted = profile["engines"]["servescope"]
    timings = fitted["timings"]
    assert min(timings["decode_ms"].values()) > 0
    assert timings["prefill_ms"] > 0
    assert fit_engine(timings, profile["shape"], profile["read_bandwidth_gbs"]) == fitted
    catalog = load_catalog(config)
    here = catalog.gpu("this machine")
    assert here.engines["servescope"]["overhead_ms"] == fitted["overhead_ms"]
    assert here.engines["servescope"]["tflops_bf16"] * 0.5 == pytest.approx(
        fitted["tflops_bf16"], rel=0.01)
    d = Deployment(catalog.model("SmolLM2-135M-Instruct"), here, "bf16", "bf16", max_seqs=4,
                   engine="servescope")
    cost = StepCost(d)
    prompt = timings["prompt_tokens"]
    prefill_error = abs(cost.prefill_seconds(prompt) * 1e3 / timings["prefill_ms"] - 1) * 100
    # Within the fit's own error, plus the prompt's attention, which the fit leaves out.
    assert prefill_error <= fitted["prefill_fit_error_pct"] + 2.0
    rate = fitted["tflops_bf16"] * 1e12
    weights_s = profile["shape"]["read_bytes"] / (here.bandwidth_gbs * 0.8 * 1e9)
    for batch in map(int, timings["decode_ms"]):
        line_ms = fitted["overhead_ms"] + fitted["per_seq_ms"] * batch + 1e3 * max(
            batch * profile["shape"]["read_bytes"] / rate, weights_s)
        assert cost.decode_seconds(batch, 0) * 1e3 == pytest.approx(line_ms, rel=0.02)
    # Another engine, or none named, is timed with the device's own figures.
    plain = StepCost(Deployment(d.model, here, "bf16", "bf16", max_seqs=4))
    # (The device's own even where it measured 0: a step that is all weight reading.)
    assert plain.overhead * 1e3 == pytest.approx(here.step_overhead_ms)
    assert plain.per_seq == 0.0


@pytest.mark.parametrize("tflops, overhead_ms, per_seq_ms", [
    (0.0095, 24.0, 4.5),   # vLLM's CPU build here: one thread, torch's bf16 linear
    (0.35, 30.0, 1.0),     # a CPU with bfloat16 instructions: reading the weights is longer
    (0.02, 5.0, 0.0),
])
def test_the_fit_recovers_the_costs_the_planner_was_given(measured, tflops, overhead_ms,
                                                           per_seq_ms):
    """Steps timed by the planner for known engine costs, fitted back: the same costs."""
    from engine.device_profile import STEP_BATCHES, fit_engine

    config, profile = measured
    here = load_catalog(config).gpu("this machine")
    engine = {"tflops_bf16": tflops / 0.5, "overhead_ms": overhead_ms, "per_seq_ms": per_seq_ms}
    here = dataclasses.replace(here, engines={"x": engine})
    d = Deployment(load_catalog(config).model("SmolLM2-135M-Instruct"), here, "bf16", "bf16",
                   max_seqs=4, engine="x")
    cost = StepCost(d)
    timings = {"engine": "x", "prompt_tokens": 52,
               "prefill_ms": cost.prefill_seconds(52) * 1e3,
               "decode_ms": {str(b): cost.decode_seconds(b, 0) * 1e3 for b in STEP_BATCHES}}
    fitted = fit_engine(timings, profile["shape"], profile["read_bandwidth_gbs"])
    assert fitted["tflops_bf16"] == pytest.approx(tflops, rel=0.05)
    assert fitted["overhead_ms"] == pytest.approx(overhead_ms, abs=0.5)
    assert fitted["per_seq_ms"] == pytest.approx(per_seq_ms, abs=0.3)


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


@pytest.mark.parametrize("table, field", [
    ("tflops_bf16 = 0.01\noverhead_ms = 20", "engines.vllm"),
    ("tflops_bf16 = 0\noverhead_ms = 20\nper_seq_ms = 1", "engines.vllm.tflops_bf16"),
    ("tflops_bf16 = 0.01\noverhead_ms = -2\nper_seq_ms = 1", "engines.vllm.overhead_ms"),
    ('tflops_bf16 = 0.01\noverhead_ms = 2\nper_seq_ms = "fast"', "engines.vllm.per_seq_ms"),
])
def test_a_wrong_engine_table_is_one_error_naming_the_file_and_field(tmp_path, table, field):
    (tmp_path / "catalogs").mkdir()
    (tmp_path / "catalogs" / "machine.toml").write_text(
        USER_GPUS.replace("My GPU", "Here") + f'\n[gpu."Here".engines.vllm]\n{table}\n')
    with pytest.raises(CatalogError, match=f"machine.toml.*{field}"):
        load_catalog(tmp_path)


def test_a_corrupt_machine_file_is_one_error_naming_it(tmp_path):
    (tmp_path / "catalogs").mkdir()
    bad = tmp_path / "catalogs" / "machine.toml"
    bad.write_text('[gpu."x"]\nmemory_gb = = 3\n')
    with pytest.raises(CatalogError, match="machine.toml"):
        load_catalog(tmp_path)


def test_measuring_again_keeps_the_profile_it_replaces(measured, tmp_path):
    """A plain re-run must not silently drop an earlier profile (vLLM's step timings measured
    by `--vllm` among them): the replaced file stays beside the new one, and the catalog reads
    only the new one."""
    from engine.device_profile import ENTRY_FILE, previous_entry, write_entry

    _, profile = measured
    earlier = dict(profile, engines={})  # as a run without any engine's fit
    first, kept = write_entry(earlier, tmp_path)
    assert kept is None and not previous_entry(first).exists()
    earlier_text = first.read_text()
    second, kept = write_entry(profile, tmp_path)
    assert second == tmp_path / "catalogs" / ENTRY_FILE
    assert kept == previous_entry(second) and kept.read_text() == earlier_text
    here = load_catalog(tmp_path).gpu("this machine")
    assert here.engines.keys() == profile["engines"].keys()
