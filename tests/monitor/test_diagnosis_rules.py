"""Diagnosis rules on series with the names the sources produce: NVML/GPM and DCGM (through the
real normaliser) for the GPU rules, which no machine here can record; vLLM's KV-cache pressure
on a recording of real vLLM (benchmarks/diagnosis_vllm_kv.py)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

from monitor.diagnosis import (
    RULES,
    THRESHOLDS,
    Condition,
    RecordedSeries,
    evaluate,
    subject_of,
    verdicts_csv,
)
from monitor.normalize import Normalizer
from monitor.nvml import GPM_METRICS
from monitor.promtext import parse_metrics

HERE = Path(__file__).parent
T0 = 1_700_000_000.0


def steady(value: float, n: int = 60, start: float = T0, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (start + np.arange(n, dtype=float), value + noise * rng.standard_normal(n))


def ramp(first: float, last: float, n: int = 60, start: float = T0):
    return start + np.arange(n, dtype=float), np.linspace(first, last, n)


GPM = dict((name, name) for name, _ in GPM_METRICS)  # the NVML source's GPM series names


def nvml_gpu(occupancy: float, dram: float, gpu: int = 0) -> dict:
    """The NvmlSource's series of one GPU (gpu/<i>/<metric>)."""
    return {f"gpu/{gpu}/{GPM['sm_occupancy_pct']}": steady(occupancy, noise=2.0, seed=gpu),
            f"gpu/{gpu}/{GPM['dram_bw_util_pct']}": steady(dram, noise=2.0, seed=gpu + 7),
            f"gpu/{gpu}/{GPM['tensor_util_pct']}": steady(occupancy / 2)}


def test_thresholds_are_named_and_explained():
    for name, t in THRESHOLDS.items():
        assert name.isupper() and len(t.why) > 30, name
    used = {c.threshold for r in RULES for c in (*r.all, *r.any, *r.unless)}
    assert used == set(THRESHOLDS)  # none unused, none missing
    with pytest.raises(ValueError, match="unknown threshold"):
        Condition("x", ("kv_cache_usage",), "max", ">=", "NO_SUCH")


def test_subjects_split_servers_and_each_gpu():
    assert subject_of("gpu/1/sm_occupancy_pct") == ("gpu", "1", "sm_occupancy_pct")
    assert subject_of("dcgm/dram_active_pct[gpu=3]") == ("dcgm", "3", "dram_active_pct")
    assert subject_of("vllm/ttft_s_p99") == ("vllm", "", "ttft_s_p99")
    assert subject_of("vllm-cost/usd_per_1m_tokens") == ("vllm", "", "usd_per_1m_tokens")
    assert subject_of("vllm/requests_finished_reason_per_s[reason=stop]")[1] == ""


def test_nvml_gpm_memory_bound_and_compute_bound_gpus_are_told_apart():
    view = RecordedSeries({**nvml_gpu(25.0, 85.0, 0), **nvml_gpu(88.0, 12.0, 1),
                           **nvml_gpu(55.0, 50.0, 2)})
    result = evaluate(view, T0, T0 + 59)
    got = {(v.rule, v.gpu) for v in result.verdicts}
    assert got == {("memory_bound", "0"), ("compute_bound", "1")}  # GPU 2 is neither
    memory = next(v for v in result.verdicts if v.rule == "memory_bound")
    assert memory.title.startswith("GPU 0 memory-bound: SM occupancy 2")
    evidence = {e.series: e for e in memory.evidence}
    assert evidence["gpu/0/sm_occupancy_pct"].value == pytest.approx(25.0, abs=1.0)
    assert evidence["gpu/0/sm_occupancy_pct"].threshold == "LOW_SM_OCCUPANCY_PCT"
    assert evidence["gpu/0/dram_bw_util_pct"].value == pytest.approx(85.0, abs=1.0)
    assert "gpu/0/tensor_util_pct" in evidence  # context, shown beside the conditions
    assert "quantize" in memory.advice


def dcgm_text(occupancy: float, dram: float) -> str:
    lines = ["# TYPE DCGM_FI_PROF_SM_OCCUPANCY gauge", "# TYPE DCGM_FI_PROF_DRAM_ACTIVE gauge"]
    for gpu in (0, 1):
        labels = f'gpu="{gpu}",UUID="GPU-{gpu}",modelName="NVIDIA H100 80GB HBM3"'
        lines += [f"DCGM_FI_PROF_SM_OCCUPANCY{{{labels}}} {occupancy if gpu == 0 else 0.5}",
                  f"DCGM_FI_PROF_DRAM_ACTIVE{{{labels}}} {dram if gpu == 0 else 0.5}"]
    return "\n".join(lines) + "\n"


def test_dcgm_profiling_fields_through_the_normaliser_name_a_memory_bound_gpu():
    normalizer = Normalizer()
    data: dict[str, list] = {}
    for i in range(30):
        for name, value in normalizer.update(parse_metrics(dcgm_text(0.2, 0.9)), T0 + i):
            data.setdefault(f"dcgm/{name}", []).append((T0 + i, value))
    assert "dcgm/sm_occupancy_pct[gpu=0]" in data and "dcgm/dram_active_pct[gpu=0]" in data
    view = RecordedSeries({k: tuple(np.array(list(c)) for c in zip(*v, strict=True))
                           for k, v in data.items()})
    result = evaluate(view, T0, T0 + 29)
    assert [(v.rule, v.source, v.gpu) for v in result.verdicts] == [("memory_bound", "dcgm", "0")]
    dram = next(e for e in result.verdicts[0].evidence if "dram" in e.series)
    assert dram.series == "dcgm/dram_active_pct[gpu=0]" and dram.value == pytest.approx(90.0)


def test_thermal_throttling_is_named_with_its_nvml_reasons():
    ts = T0 + np.arange(40, dtype=float)
    # GpuIdle (0x1) for the first half, HW thermal + SW thermal slowdown (0x60) after.
    reasons = np.where(np.arange(40) < 20, 0x1, 0x60).astype(float)
    view = RecordedSeries({"gpu/0/throttle_reasons": (ts, reasons),
                           "gpu/0/sm_clock_mhz": (ts, np.where(reasons > 1, 1100.0, 1980.0)),
                           "gpu/0/temperature_c": (ts, np.where(reasons > 1, 89.0, 60.0)),
                           "gpu/1/throttle_reasons": (ts, np.full(40, 0x1 | 0x10, float))})
    result = evaluate(view, T0, T0 + 39)
    assert [(v.rule, v.gpu) for v in result.verdicts] == [("gpu_throttling", "0")]
    v = result.verdicts[0]
    assert v.title == ("GPU 0 clocks throttled (software thermal slowdown, hardware thermal "
                       "slowdown) in 50% of the window")
    clock = next(e for e in v.evidence if e.series == "gpu/0/sm_clock_mhz")
    assert clock.summary["min"] == 1100.0 and clock.summary["max"] == 1980.0


def test_power_cap_alone_under_the_share_is_not_throttling():
    ts = T0 + np.arange(40, dtype=float)
    reasons = np.where(np.arange(40) < 5, 0x4, 0x0).astype(float)  # 12.5% of the samples
    result = evaluate(RecordedSeries({"gpu/0/throttle_reasons": (ts, reasons)}), T0, T0 + 39)
    assert result.verdicts == []


def test_ecc_corrections_counted_across_a_counter_reset():
    ts = T0 + np.arange(6, dtype=float)
    # 3 corrected, then the driver reloaded (counter restarts at 0) and 2 more.
    view = RecordedSeries({"gpu/0/ecc_corrected_total": (ts, np.array([10, 11, 13, 0, 1, 2.]))})
    v = evaluate(view, T0, T0 + 5).verdicts
    assert [x.title for x in v] == ["GPU 0 corrected 5 ECC errors in the window"]
    steady_count = RecordedSeries({"gpu/0/ecc_corrected_total": (ts, np.full(6, 13.0))})
    assert evaluate(steady_count, T0, T0 + 5).verdicts == []


def test_throughput_drop_with_a_shrinking_batch_and_a_queue():
    view = RecordedSeries({"vllm/generation_tokens_per_s": ramp(900.0, 400.0),
                           "vllm/requests_running": ramp(32.0, 12.0),
                           "vllm/requests_waiting": ramp(0.0, 9.0),
                           "vllm/kv_cache_usage": steady(0.97)})
    rules = {v.rule: v for v in evaluate(view, T0, T0 + 59).verdicts}
    assert "throughput_drop_batch" in rules
    ev = {e.series: e for e in rules["throughput_drop_batch"].evidence}
    assert ev["vllm/generation_tokens_per_s"].value == pytest.approx(
        np.mean(np.linspace(900, 400, 60)[-20:]) / np.mean(np.linspace(900, 400, 60)[:20]),
        rel=0.05)
    assert "queue_growth" in rules  # waiting went from ~1.5 to ~7.5


def test_throughput_drop_from_longer_sequences_with_the_batch_kept():
    view = RecordedSeries({"vllm/generation_tokens_per_s": ramp(900.0, 500.0),
                           "vllm/requests_running": steady(16.0),
                           "vllm/requests_waiting": steady(0.0),
                           "vllm/request_prompt_tokens_mean": ramp(500.0, 1500.0)})
    got = [v.rule for v in evaluate(view, T0, T0 + 59).verdicts]
    assert got == ["throughput_drop_longer"]


def test_less_load_is_not_a_throughput_problem():
    view = RecordedSeries({"vllm/generation_tokens_per_s": ramp(900.0, 100.0),
                           "vllm/requests_running": ramp(16.0, 0.0),
                           "vllm/requests_waiting": steady(0.0)})
    result = evaluate(view, T0, T0 + 59)
    assert result.verdicts == []
    assert "memory_bound" in result.not_evaluated  # no GPU series at all
    assert "not judged for want of series" in result.summary()


def test_cost_per_token_up_without_throughput_up_is_an_efficiency_regression():
    view = RecordedSeries({"vllm-cost/usd_per_1m_tokens": ramp(1.0, 1.6),
                           "vllm/generation_tokens_per_s": ramp(1000.0, 640.0),
                           "vllm/requests_running": steady(16.0, noise=0.5)})
    rules = [v for v in evaluate(view, T0, T0 + 59).verdicts if v.rule == "efficiency_regression"]
    assert len(rules) == 1 and rules[0].source == "vllm"
    assert "cost per 1M tokens up +" in rules[0].title
    # The same cost rise with the demand gone is not a regression of the server.
    gone = RecordedSeries({**view.data, "vllm/requests_running": ramp(16.0, 2.0)})
    assert not [v for v in evaluate(gone, T0, T0 + 59).verdicts
                if v.rule == "efficiency_regression"]


RECORDING = HERE / "diagnosis_vllm_kv.json"


@pytest.fixture(scope="module")
def vllm_recording():
    return json.loads(RECORDING.read_text())


def test_real_vllm_with_too_small_a_kv_cache_is_named_kv_pressure(vllm_recording):
    """Recorded from real vLLM (benchmarks/diagnosis_vllm_kv.py: a KV cache of 1,536 tokens,
    12 concurrent requests of ~230 tokens): the p99 TTFT spike is put on KV pressure."""
    meta = vllm_recording["meta"]
    assert meta["vllm"] and meta["kv_tokens"] == 1536
    view = RecordedSeries.from_json(vllm_recording["series"])
    start, end = view.span()
    result = evaluate(view, start, end)
    kv = [v for v in result.verdicts if v.rule == "kv_pressure"]
    assert len(kv) == 1, result.summary()
    series = vllm_recording["series"]
    preempted = series["vllm/preemptions_total"][-1][1] - series["vllm/preemptions_total"][0][1]
    assert preempted >= 1
    assert kv[0].title.startswith(f"p99 TTFT spike with KV cache full and {preempted:.0f} "
                                  "preemptions")
    ev = {e.series: e for e in kv[0].evidence}
    assert ev["vllm/kv_cache_usage"].value >= 0.9
    assert ev["vllm/ttft_s_p99"].value >= 3.0  # p99 over the median p50
    # The p99 is vLLM's histogram estimate: the title names the bucket it lies in.
    lo, hi = ev["vllm/ttft_s_p99"].bucket
    assert f", between {lo:.4g} and {hi:.4g} s," in kv[0].title
    # A long request is not blamed where preemptions explain the tail.
    assert "long_request" not in {v.rule for v in result.verdicts}
    # The light load alone (before the heavy one began): nothing to name.
    light = meta["loads"]["light"]
    calm = evaluate(view, start, light["ended_s"])
    assert "kv_pressure" not in {v.rule for v in calm.verdicts}


def test_a_histogram_p99_carries_its_bucket_into_the_verdict():
    """The p99 TTFT a verdict quotes is a histogram estimate: its title and evidence say which
    bucket the true value lies in (the one stored with the highest reading), in words; the
    same rule on exact percentiles (the embedded engine's) says nothing of buckets."""
    ts = T0 + np.arange(60, dtype=float)
    p99 = np.where(np.arange(60) == 40, 19.8, 0.6)
    series = {"vllm/ttft_s_p50": steady(0.4), "vllm/ttft_s_p99": (ts, p99),
              "vllm/ttft_s_p99_lo": (ts, np.where(p99 > 10, 10.0, 0.5)),
              "vllm/ttft_s_p99_hi": (ts, np.where(p99 > 10, 20.0, 0.75)),
              "vllm/kv_cache_usage": steady(0.97), "vllm/preemptions_total": ramp(0, 12)}
    verdict = next(v for v in evaluate(RecordedSeries(series), T0, T0 + 59).verdicts
                   if v.rule == "kv_pressure")
    assert "p99 TTFT up to 19.8 s, between 10 and 20 s, 50x the median p50" in verdict.title
    ev = {e.series: e for e in verdict.evidence}
    assert ev["vllm/ttft_s_p99"].bucket == (10.0, 20.0)
    exact = {k: v for k, v in series.items() if not k.endswith(("_lo", "_hi"))}
    verdict = next(v for v in evaluate(RecordedSeries(exact), T0, T0 + 59).verdicts
                   if v.rule == "kv_pressure")
    assert "up to 19.8 s, 50x" in verdict.title and "between" not in verdict.title
    # Above the last finite bound the bucket has no upper end.
    series["vllm/ttft_s_p99_hi"] = (ts[:40], series["vllm/ttft_s_p99_hi"][1][:40])
    verdict = next(v for v in evaluate(RecordedSeries(series), T0, T0 + 59).verdicts
                   if v.rule == "kv_pressure")
    assert "up to 19.8 s, above 10 s," in verdict.title
    assert verdict.to_dict()["evidence"][0]["bucket"] == (10.0, None)


def test_verdicts_export_as_csv_with_their_evidence(vllm_recording):
    view = RecordedSeries.from_json(vllm_recording["series"])
    verdicts = [v.to_dict() for v in evaluate(view, *view.span()).verdicts]
    text = verdicts_csv(verdicts)
    assert text.splitlines()[0] == "rule,kind,source,gpu,title,start_s,end_s,evidence,advice"
    rows = {r["rule"]: r for r in csv.DictReader(io.StringIO(text))}
    assert rows["kv_pressure"]["title"].startswith("p99 TTFT spike with KV cache full")
    assert "max of vllm/kv_cache_usage over" in rows["kv_pressure"]["evidence"]
    assert float(rows["kv_pressure"]["end_s"]) > float(rows["kv_pressure"]["start_s"])


def test_a_queue_growing_from_nothing_is_named_and_stays_plain_json():
    waiting = np.concatenate((np.zeros(20), np.linspace(0, 6, 20), np.full(20, 6.0)))
    view = RecordedSeries({"vllm/requests_waiting": (T0 + np.arange(60.0), waiting),
                           "vllm/requests_running": steady(8.0)})
    verdicts = evaluate(view, T0, T0 + 59).verdicts
    assert [v.title for v in verdicts] == ["queue growing: 6.0 requests waiting on average, "
                                           "up from 0.0"]
    growth = verdicts[0].evidence[0]
    assert growth.value is None and "is a rise from 0" in growth.sentence()
    json.dumps([v.to_dict() for v in verdicts], allow_nan=False)  # strict JSON: no Infinity


def test_dcgm_ecc_and_throttle_fields_through_the_normaliser_reach_their_rules():
    normalizer = Normalizer()
    data: dict[str, list] = {}
    labels = 'gpu="0",UUID="GPU-0",modelName="NVIDIA H100 80GB HBM3"'
    for i in range(30):
        text = ("# TYPE DCGM_FI_DEV_ECC_SBE_VOL_TOTAL counter\n"
                f"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{labels}}} {100 + i // 10}\n"
                "# TYPE DCGM_FI_DEV_CLOCK_THROTTLE_REASONS gauge\n"
                f"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{labels}}} {0x20 if i >= 10 else 0}\n")
        for name, value in normalizer.update(parse_metrics(text), T0 + i):
            data.setdefault(f"dcgm/{name}", []).append((T0 + i, value))
    view = RecordedSeries({k: tuple(np.array(list(c)) for c in zip(*v, strict=True))
                           for k, v in data.items()})
    titles = sorted(v.title for v in evaluate(view, T0, T0 + 29).verdicts)
    assert titles[0].startswith("GPU 0 clocks throttled (software thermal slowdown)")
    assert titles[1] == "GPU 0 corrected 2 ECC errors in the window"


def test_throttling_on_a_remote_box_read_through_nvidia_smi():
    """The SSH source's GPU series (monitor.ssh.smi parses nvidia-smi's CSV rows into the
    names NvmlSource uses): an H100 at its power cap in most rows."""
    from monitor.ssh.smi import THROTTLE_FIELDS, parse_row, query

    fields = query(THROTTLE_FIELDS[0]).split(",")
    data: dict[str, list] = {}
    for i in range(30):
        reasons = "0x0000000000000004" if i >= 10 else "0x0000000000000000"
        clock = 1410 if i >= 10 else 1980
        row = (f"0, 97, 61, 70123, 81559, 699.81, 700.00, 71, {clock}, 2619, [N/A], {reasons}")
        gpu, values = parse_row(row, fields)
        for series, value in values.items():
            data.setdefault(f"box/{gpu}/{series}", []).append((T0 + i, value))
    view = RecordedSeries({k: tuple(np.array(c) for c in zip(*v, strict=True))
                           for k, v in data.items()})
    verdicts = evaluate(view, T0, T0 + 29).verdicts
    assert [(v.rule, v.source, v.gpu) for v in verdicts] == [("gpu_throttling", "box", "0")]
    assert verdicts[0].title == "GPU 0 clocks throttled (software power cap) in 67% of the window"
    power = next(e for e in verdicts[0].evidence if e.series == "box/0/power_w")
    assert power.summary["max"] == pytest.approx(699.81)
