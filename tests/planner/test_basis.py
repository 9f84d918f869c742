"""Every predicted figure says what it rests on and carries its error band from the validation
set (assets/validation/published.json, or any file of the same shape)."""

from __future__ import annotations

import json

import pytest

from planner.calibrate import deployment_for, load_measurements, predict
from planner.catalog import CatalogError, load_catalog
from planner.evaluate import evaluate, evaluation_dict
from planner.timing import Deployment, Efficiency
from planner.validation import (
    DATA,
    LatencyPoint,
    basis,
    error_bands,
    load_latency_points,
    predict_latency,
)
from planner.workload import Workload


def test_bands_come_from_a_validation_file_of_known_errors(tmp_path):
    """Two runs measured 1.25x and 0.8x what the planner predicts: errors 20% and 25%."""
    catalog = load_catalog()
    row = {"model": "Llama-3.1-8B", "gpu": "H100 SXM", "weights": "bf16", "kv": "bf16",
           "tp": 1, "pp": 1, "input_len": 128, "output_len": 128, "mode": "static",
           "source": "test", "engine": "test engine"}
    rows = []
    for batch, factor in ((8, 1.25), (64, 0.8)):
        probe = load_measurements_row({**row, "batch": batch, "throughput_tok_s": 1.0})
        predicted = predict(deployment_for(probe, catalog), probe, Efficiency())
        rows.append({**row, "batch": batch,
                     "throughput_tok_s": predicted["throughput_tok_s"] * factor})
    path = tmp_path / "published.json"
    path.write_text(json.dumps({"measurements": rows}))
    band = error_bands(path)["throughput"]
    assert band.points == 2
    assert band.median_pct == pytest.approx(22.5)
    assert band.max_pct == pytest.approx(25.0)
    assert band.bias_pct == pytest.approx(2.5)  # -20% and +25%
    assert "test engine" in band.against
    assert "tpot" not in error_bands(path)  # no TPOT points, no TPOT band


def load_measurements_row(row):
    from planner.calibrate import Measurement

    return Measurement(**row)


def test_shipped_bands_count_every_point_of_the_shipped_set():
    data = json.loads(DATA.read_text())
    bands = error_bands()
    assert bands["throughput"].points == len(load_measurements(DATA))
    for metric in ("tpot", "ttft"):
        published = [row for row in data["latency_points"] if row.get(f"{metric}_ms")]
        assert bands[metric].points == len(published)
        assert all(row["source"] and row["engine"] for row in published)
    # Leave-one-out calibration is judged on runs it did not see: no better than in-sample 0.
    assert bands["throughput_calibrated"].median_pct > 0


def test_an_evaluation_says_what_each_figure_rests_on():
    catalog = load_catalog()
    d = Deployment(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"))
    out = evaluation_dict(evaluate(d, Workload(512, 128, rate=2, num_requests=100)))
    b = out["basis"]
    assert "uncalibrated" in b["throughput_tok_s"]["rests_on"]
    assert b["throughput_tok_s"]["error_band"]["points"] == error_bands()["throughput"].points
    assert b["cost_per_hour"]["error_band"] is None and "prices.toml" in b["cost_per_hour"][
        "rests_on"]
    assert "p99 under Poisson load" in b["ttft_p99_ms"]["note"]


def test_a_calibrated_plan_names_its_calibration_and_takes_the_leave_one_out_band():
    b = basis("fitted on 3 local runs")
    assert "'fitted on 3 local runs'" in b["throughput_tok_s"]["rests_on"]
    loo = error_bands()["throughput_calibrated"].median_pct
    assert b["throughput_tok_s"]["error_band"]["median_abs_error_pct"] == round(loo, 1)


LATENCY_ROW = {"model": "Llama-3.1-70B", "gpu": "H100 SXM", "weights": "fp8", "kv": "fp8",
               "tp": 2, "pp": 1, "concurrency": 1, "input_len": 5000, "output_len": 500,
               "mode": "continuous", "statistic": "mean", "engine": "test engine",
               "source": "test", "tpot_ms": 20.0, "ttft_ms": 400.0}


def test_a_wrong_latency_point_is_one_error_naming_the_file_and_row(tmp_path):
    path = tmp_path / "published.json"
    path.write_text(json.dumps({"measurements": [], "latency_points": [
        LATENCY_ROW, {**LATENCY_ROW, "statistic": "p90"}]}))
    with pytest.raises(CatalogError, match=r"published.json: latency_points\[1\]: statistic"):
        load_latency_points(path)
    path.write_text(json.dumps({"latency_points": [{**LATENCY_ROW, "tpot_ms": None,
                                                     "ttft_ms": None}]}))
    with pytest.raises(CatalogError, match=r"latency_points\[0\]: .*needs tpot_ms or ttft_ms"):
        load_latency_points(path)


def test_a_closed_loop_past_the_kv_cache_queues_as_the_published_table_does():
    """Above the requests the KV cache holds, more concurrency adds waiting, not batch: TPOT
    levels off while TTFT grows with the queue (NIM's 70B table: TPOT 93 ms from 100 to 250
    concurrent, TTFT 8 s to 89 s)."""
    catalog = load_catalog()
    at = {n: predict_latency(LatencyPoint(**{**LATENCY_ROW, "concurrency": n}), catalog)
          for n in (1, 25, 150, 250)}
    assert at[25]["tpot_ms"] > 1.5 * at[1]["tpot_ms"]  # a bigger batch below the limit
    assert at[250]["tpot_ms"] == pytest.approx(at[150]["tpot_ms"], rel=0.05)
    assert at[250]["ttft_ms"] > 1.5 * at[150]["ttft_ms"] > 10 * at[25]["ttft_ms"]


def test_a_runs_time_over_its_tokens_is_predicted_as_such():
    """TensorRT-LLM's peak-throughput and vLLM's latency tables give a run's whole time over its
    output tokens: the prediction is the static batch's prefill plus decodes over the same."""
    catalog = load_catalog()
    row = {**LATENCY_ROW, "mode": "static", "concurrency": 8, "input_len": 32,
           "output_len": 128, "ttft_ms": None}
    decode = predict_latency(LatencyPoint(**row), catalog)
    whole = predict_latency(LatencyPoint(**{**row, "tpot_is": "e2e_per_token"}), catalog)
    assert whole["tpot_ms"] == pytest.approx(
        (decode["ttft_ms"] + 127 * decode["tpot_ms"]) / 128)
    assert whole["tpot_ms"] > decode["tpot_ms"]
