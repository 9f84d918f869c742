"""Calibration from measured runs: engine benchmarks and stored load tests of known efficiency."""

from __future__ import annotations

import dataclasses
import json

import pytest

from planner.calibrate import Measurement, deployment_for, predict
from planner.catalog import load_catalog
from planner.measured import (
    calibrate_measured,
    from_engine,
    from_runs,
    load_engine_results,
    match_gpu,
    match_model,
)
from planner.timing import Deployment, Efficiency

TRUTH = Efficiency(flops=0.5, memory=0.7)
LEVELS = (1, 16, 64)
PROMPT, NEW = 1000, 64


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _tok_s(catalog, gpu: str, batch: int, inp: int, out: int, mode: str = "static",
           eff: Efficiency = TRUTH, weights: str = "bf16") -> float:
    m = Measurement("Llama-3.1-8B", gpu, weights, "bf16", 1, 1, batch, inp, out, 1.0, mode=mode)
    return predict(deployment_for(m, catalog), m, eff)["throughput_tok_s"]


def engine_result(catalog, device: str = "cuda:0", gpu: str = "NVIDIA L40S",
                  eff: Efficiency = TRUTH, weights: str = "float") -> dict:
    """A record shaped like engine.bench's, whose figures a known efficiency produced (with the
    engine's weight format: "float", "int8", "int4:g32", ...)."""
    catalog_gpu = match_gpu(gpu, catalog) or "L40S"
    precision = {"float": "bf16"}.get(weights, weights.split(":")[0])
    return {"model": "meta-llama/Llama-3.1-8B-Instruct", "device": device, "dtype": "bfloat16",
            "weights": weights, "quick": False, "machine": {"gpus": [gpu]},
            "config": {"prompt_tokens": PROMPT, "new_tokens": NEW},
            "throughput_tokens_per_s": {str(n): _tok_s(catalog, catalog_gpu, n, PROMPT, NEW,
                                                       eff=eff, weights=precision)
                                        for n in LEVELS}}


def test_device_and_model_names_map_to_the_catalog(catalog):
    assert match_gpu("NVIDIA A100-SXM4-80GB", catalog) == "A100 80GB"
    assert match_gpu("NVIDIA H100 80GB HBM3", catalog) == "H100 SXM"
    assert match_gpu("NVIDIA H100 PCIe", catalog) == "H100 PCIe"
    assert match_gpu("NVIDIA L4", catalog) == "L4"
    assert match_gpu("NVIDIA GeForce RTX 3060", catalog) is None
    assert match_model("meta-llama/Llama-3.1-8B-Instruct", catalog) == "Llama-3.1-8B"
    assert match_model("Qwen/Qwen3-0.6B", catalog) is None


def test_engine_results_fit_recovers_the_factor(catalog, tmp_path, monkeypatch):
    monkeypatch.setenv("SERVESCOPE_DATA_DIR", str(tmp_path))
    lines = [json.dumps(engine_result(catalog)), "not json",
             json.dumps({**engine_result(catalog), "device": "cpu"})]
    (tmp_path / "bench_results.jsonl").write_text("\n".join(lines) + "\n")
    results = load_engine_results()
    assert len(results) == 2
    report = calibrate_measured(results, [], catalog)
    cal = report.calibration
    eff = cal.efficiency("L40S", "bf16")
    assert eff.flops == pytest.approx(0.5, abs=0.051)
    assert eff.memory == pytest.approx(0.7, abs=0.051)
    assert cal.fit_error_pct < 2.0 and cal.points == len(LEVELS)
    # Fitted on an L40S: an H100 keeps the uncalibrated defaults.
    assert cal.efficiency("H100 SXM", "bf16") == Efficiency()
    assert "L40S bf16" in cal.name
    assert len(report.skipped) == 1 and "CPU" in report.skipped[0]


def test_a_cpu_only_history_cannot_calibrate(catalog):
    points, skipped = from_engine([engine_result(catalog, device="cpu")], catalog)
    assert points == [] and "CPU run" in skipped[0]
    with pytest.raises(ValueError, match="CPU run says nothing"):
        calibrate_measured([engine_result(catalog, device="cpu")], [], catalog)


def test_stored_load_tests_fit_per_gpu(catalog):
    eff_l4 = Efficiency(flops=0.4, memory=0.6)
    runs = [{"id": i, "kind": "loadtest", "name": "remote",
             "config": {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "NVIDIA L4",
                        "concurrency": n, "input_len": inp, "output_len": out},
             "summary": {"output_tokens_per_s": _tok_s(catalog, "L4", n, inp, out,
                                                       "continuous", eff_l4)}}
            # Long prompts and short answers put the prefill on the compute roof: FLOPs show.
            for i, (n, inp, out) in enumerate(((1, 128, 128), (16, 4096, 32), (64, 2048, 16)))]
    runs.append({"id": 9, "kind": "loadtest", "config": {"model": "gpt2", "concurrency": 4},
                 "summary": {"output_tokens_per_s": 100.0}})
    runs.append({"id": 10, "kind": "loadtest",
                 "config": {"model": "Llama-3.1-8B", "rate": 2.0, "gpu": "L4"},
                 "summary": {"output_tokens_per_s": 100.0}})
    points, skipped = from_runs(runs, catalog)
    assert len(points) == 3 and len(skipped) == 2
    assert "no catalog model" in skipped[0] and "without a measured TPOT" in skipped[1]
    report = calibrate_measured([engine_result(catalog)], runs, catalog)
    cal = report.calibration
    assert cal.efficiency("L4", "bf16").flops == pytest.approx(0.4, abs=0.051)
    assert cal.efficiency("L4", "bf16").memory == pytest.approx(0.6, abs=0.051)
    assert cal.efficiency("L40S", "bf16").memory == pytest.approx(0.7, abs=0.051)
    assert cal.fit_error_pct < 2.0 and "6 point" in report.summary()


def test_an_open_loop_run_calibrates_at_its_mean_batch(catalog):
    """A rate run (a plan's own workload, run here) decodes at no fixed batch: Little's law
    gives its mean, output tokens/s x mean TPOT (here 120 tok/s x 50 ms = 6 sequences)."""
    run = {"id": 3, "kind": "loadtest", "name": "plan run",
           "config": {"model": "Llama-3.1-8B", "rate": 2.0, "gpu": "L4", "input_len": 256,
                      "output_len": 64},
           "summary": {"output_tokens_per_s": 120.0, "tpot_ms": {"mean": 50.0, "p50": 48.0}}}
    [point], skipped = from_runs([run], catalog)
    assert skipped == [] and point.batch == 6 and point.gpu == "L4"
    assert point.throughput_tok_s == 120.0 and point.mode == "continuous"


def test_the_demo_model_calibrates_and_a_model_not_in_the_catalog_once_added(catalog):
    """The demo model ships in the catalog, so its benchmark on a catalog GPU becomes
    calibration points at once; a model the catalog lacks, built from its loaded architecture
    (SmolLM2-135M's, under another name) and added, does too."""
    from planner.hf_import import model_from_architecture

    record = {"model": "smollm2-135m-instruct", "device": "cuda:0", "dtype": "bfloat16",
              "machine": {"gpus": ["NVIDIA H200"]}, "config": {"prompt_tokens": 32,
                                                               "new_tokens": 16},
              "throughput_tokens_per_s": {"1": 300.0, "4": 1100.0}}
    points, skipped = from_engine([record], catalog)
    assert skipped == [] and {p.model for p in points} == {"SmolLM2-135M"}
    model = model_from_architecture("my-tiny-llama", "loaded", 30, 576, 9, 3, 64, 1536,
                                    49152, 8192)
    # 30 x (576*64*(18+6) + 3*576*1536 + 2*576) + 2*49152*576 + 576 parameters
    assert model.params_b * 1e9 == pytest.approx(162_826_560)
    record = {**record, "model": "my-tiny-llama"}
    _, skipped = from_engine([record], catalog)
    assert "model not in the catalog" in skipped[0]
    points, skipped = from_engine([record], catalog.with_model(model))
    assert skipped == [] and [(p.gpu, p.batch, p.input_len) for p in points] == [
        ("H200", 1, 32), ("H200", 4, 32)]
    report = calibrate_measured([record], [], catalog.with_model(model))
    assert report.calibration.name == "measured (H200 bf16)" and report.calibration.points == 2


def test_a_quantized_benchmark_calibrates_its_own_precision(catalog):
    # An int4 run moves a quarter of bf16's weight bytes; read as bf16, the same tokens/s would
    # credit the GPU with far more memory efficiency than it has (issue #16, item 3).
    report = calibrate_measured([engine_result(catalog, weights="int4:g32")], [], catalog)
    cal = report.calibration
    assert [(m.weights, m.kv) for m in report.used] == [("int4", "bf16")] * len(LEVELS)
    assert "L40S int4" in cal.name
    eff = cal.efficiency("L40S", "int4")
    assert eff.flops == pytest.approx(0.5, abs=0.051)
    assert eff.memory == pytest.approx(0.7, abs=0.051)
    assert cal.efficiency("L40S", "bf16") == Efficiency()  # nothing was measured in bf16
    int8 = from_engine([{**engine_result(catalog, weights="int8"), "kv_cache_dtype": "fp8"}],
                       catalog)[0]
    assert {(m.weights, m.kv) for m in int8} == {("int8", "fp8")}
    points, skipped = from_engine([{**engine_result(catalog), "weights": "int3"}], catalog)
    assert points == [] and "weights 'int3'" in skipped[0]


def test_a_run_at_batch_1_with_its_ttft_pins_the_flops_factor(catalog):
    """Decode at batch 1 hardly touches the compute roof, so its throughput barely constrains
    the FLOPs factor; its TTFT (a prefill, which does) pins it. One stored run at concurrency 1,
    with the p50 TPOT and TTFT of a known efficiency, recovers that efficiency's FLOPs factor."""
    truth = Efficiency(flops=0.4, memory=0.6)
    m = Measurement("Llama-3.1-8B", "L4", "bf16", "bf16", 1, 1, 1, 2048, 64, 1.0,
                    mode="continuous")
    figures = predict(deployment_for(m, catalog), m, truth)
    run = {"id": 1, "kind": "loadtest", "name": "plan run",
           "config": {"model": "Llama-3.1-8B", "gpu": "L4", "concurrency": 1, "input_len": 2048,
                      "output_len": 64},
           "summary": {"output_tokens_per_s": figures["throughput_tok_s"],
                       "tpot_ms": {"p50": figures["tpot_ms"]},
                       "ttft_ms": {"p50": figures["ttft_ms"]}}}
    [point], _ = from_runs([run], catalog)
    assert (point.tpot_ms, point.ttft_ms) == (figures["tpot_ms"], figures["ttft_ms"])
    cal = calibrate_measured([], [run], catalog).calibration
    assert cal.efficiency("L4", "bf16").flops == pytest.approx(0.4, abs=0.051)
    assert cal.efficiency("L4", "bf16").memory == pytest.approx(0.6, abs=0.051)
    # Without the TTFT the same run still pins the memory factor; the FLOPs factor then rests
    # only on the ridge blend's share of batch-1 GEMM compute, a weak hold.
    del run["summary"]["ttft_ms"]
    loose = calibrate_measured([], [run], catalog).calibration.efficiency("L4", "bf16")
    assert loose.memory == pytest.approx(0.6, abs=0.051)


def test_an_engine_timed_here_is_calibrated_as_a_whole(catalog):
    """An engine whose steps were timed on the device is slowed or sped by one factor on its
    rate, reads and step costs together: runs of an engine 1.5x slower than timed, at batch 1
    and 4, give back 1.5x, where the free grid could trade the three off."""
    from planner.calibrate import _grid_fit

    engine = {"tflops_bf16": 0.02, "overhead_ms": 10.0, "per_seq_ms": 2.0}
    gpu = dataclasses.replace(catalog.gpu("L4"), engines={"x": engine}, step_overhead_ms=5.0)
    model = catalog.model("Llama-3.1-8B")
    truth = Efficiency(flops=0.5 / 1.5, memory=0.8 / 1.5, overhead_ms=15.0)
    runs, deployments = [], []
    for batch in (1, 4):
        m = Measurement("Llama-3.1-8B", "L4", "bf16", "bf16", 1, 1, batch, 256, 64, 1.0,
                        mode="continuous", engine="x")
        d = Deployment(model, gpu, max_seqs=batch, engine="x")
        figures = predict(d, m, truth)
        runs.append(dataclasses.replace(m, throughput_tok_s=figures["throughput_tok_s"],
                                        tpot_ms=figures["tpot_ms"], ttft_ms=figures["ttft_ms"]))
        deployments.append(d)
    error, eff, _ = _grid_fit(runs, deployments)
    assert error < 3.0  # the grid steps 3.5% between factors
    assert eff.overhead_ms == pytest.approx(15.0, rel=0.04)
    assert eff.flops == pytest.approx(0.5 / 1.5, rel=0.04)


def test_a_closed_loop_run_calibrates_as_the_simulator_runs_it(catalog):
    """A closed loop of fixed lengths runs in lockstep: all its prompts prefilled, then decoded
    together. On a device where one prefill costs some 30 decode steps (the demo model served
    by vLLM's CPU build here), one run at concurrency 1 of an engine served 1.25x slower than
    its timed steps, simulated by the planner itself, must calibrate to that slowdown, and the
    calibrated planner must then give back that run and one at concurrency 4. Read as a
    continuous batch, the prefill spread over the decode steps doubled the run's TPOT and the
    fit traded the engine's speed against it."""
    from planner.calibrate import Calibration
    from planner.evaluate import evaluate
    from planner.workload import Workload

    engine = {"tflops_bf16": 0.019, "overhead_ms": 4.5, "per_seq_ms": 2.1}  # vLLM here
    cpu = dataclasses.replace(catalog.gpu("L4"), bandwidth_gbs=24.0, engines={"vllm": engine},
                              step_overhead_ms=4.5)
    here = dataclasses.replace(catalog, gpus={**catalog.gpus, "L4": cpu})
    model = here.model("SmolLM2-135M")
    slow = 1.25
    truth = Calibration("served slower", {("*", "*"): Efficiency(
        flops=Efficiency().flops / slow, memory=min(1.0, Efficiency().memory / slow),
        overhead_ms=4.5 * slow)})

    def run(concurrency: int, calibration: Calibration) -> dict:
        d = Deployment(model, cpu, max_seqs=concurrency, engine="vllm")
        w = Workload(52, 32, concurrency=concurrency, num_requests=16)
        r = evaluate(d, w, 1, calibration).result
        return {"output_tokens_per_s": r.run_throughput_tok_s,
                "tpot_ms": {"p50": r.summary("tpot")["p50"]},
                "ttft_ms": {"p50": r.summary("ttft")["p50"]}}

    measured = {c: run(c, truth) for c in (1, 4)}
    calibration = calibrate_measured([], [_stored_run(1, measured[1])], here).calibration
    assert calibration.efficiency("L4", "bf16").overhead_ms == pytest.approx(4.5 * slow,
                                                                             rel=0.04)
    for c, figures in measured.items():
        again = run(c, calibration)
        assert again["output_tokens_per_s"] == pytest.approx(figures["output_tokens_per_s"],
                                                             rel=0.03)
        for key in ("tpot_ms", "ttft_ms"):
            assert again[key]["p50"] == pytest.approx(figures[key]["p50"], rel=0.03)


def _stored_run(concurrency: int, summary: dict) -> dict:
    """A `plan run-here` of the demo model on vLLM as storage.queries.list_runs gives it."""
    return {"id": concurrency, "kind": "loadtest", "name": "plan run",
            "config": {"model": "SmolLM2-135M", "gpu": "L4", "engine": "vLLM 0.32.0",
                       "concurrency": concurrency, "input_len": 52, "output_len": 32},
            "summary": summary}


def test_a_run_at_concurrency_4_measures_what_serving_adds_per_sequence(catalog):
    """Served vLLM here matched its offline steps at one sequence and decoded slower at four:
    serving costs per sequence (streaming, detokenizing, the API process on the same cores).
    A run at concurrency 4 of an engine served as timed but with 2 ms a sequence a step on
    top, simulated by the planner, calibrates to that cost with the engine's speed kept, and
    the calibrated planner gives back the run at concurrency 1 too."""
    from planner.calibrate import Calibration
    from planner.evaluate import evaluate
    from planner.workload import Workload

    engine = {"tflops_bf16": 0.33, "overhead_ms": 23.8, "per_seq_ms": 0.8}  # vLLM here, bf16
    cpu = dataclasses.replace(catalog.gpu("L4"), bandwidth_gbs=20.0, engines={"vllm": engine},
                              step_overhead_ms=23.8)
    here = dataclasses.replace(catalog, gpus={**catalog.gpus, "L4": cpu})
    model = here.model("SmolLM2-135M")
    truth = Calibration("served", {("*", "*"): Efficiency(overhead_ms=23.8,
                                                          serving_ms_per_seq=2.0)})

    def run(concurrency: int, calibration: Calibration) -> dict:
        d = Deployment(model, cpu, max_seqs=concurrency, engine="vllm")
        r = evaluate(d, Workload(52, 32, concurrency=concurrency, num_requests=16), 1,
                     calibration).result
        return {"output_tokens_per_s": r.run_throughput_tok_s,
                "tpot_ms": {"p50": r.summary("tpot")["p50"]},
                "ttft_ms": {"p50": r.summary("ttft")["p50"]}}

    measured = {c: run(c, truth) for c in (1, 4)}
    eff = calibrate_measured([], [_stored_run(4, measured[4])], here).calibration.efficiency(
        "L4", "bf16")
    assert eff.serving_ms_per_seq == pytest.approx(2.0, abs=0.25)
    assert eff.overhead_ms == pytest.approx(23.8, rel=0.04)
    again = run(1, Calibration("fitted", {("*", "*"): eff}))
    assert again["tpot_ms"]["p50"] == pytest.approx(measured[1]["tpot_ms"]["p50"], rel=0.03)
