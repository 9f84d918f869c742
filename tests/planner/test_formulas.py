"""Hand-computed cases for the catalog, memory, time-model and cost formulas."""

from __future__ import annotations

import dataclasses
import json

import pytest

from planner.calibrate import Calibration, Measurement, fit, predict
from planner.catalog import CatalogError, UnknownNameError, load_catalog
from planner.cost import CostOptions, autoscaled_cost, cost_per_million, gpu_hour_price
from planner.hf_import import count_params, model_from_hf_config
from planner.memory import kv_bytes_per_token, kv_bytes_per_token_per_gpu, plan_memory, weight_bytes
from planner.timing import (
    Deployment,
    Efficiency,
    SpecDecode,
    StepCost,
    allreduce_seconds,
    send_seconds,
)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_has_required_entries_with_sources(catalog):
    for name in ("H100 SXM", "H100 PCIe", "H200", "B200", "A100 80GB", "A100 40GB", "L40S", "L4",
                 "A10G", "RTX 4090", "MI300X"):
        gpu = catalog.gpu(name)
        assert gpu.source and gpu.date and gpu.price_source and gpu.on_demand > 0
    for name in ("Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B", "Llama-2-70B", "Mixtral-8x7B",
                 "Qwen2.5-7B", "Qwen2.5-72B", "DeepSeek-V3"):
        assert catalog.model(name).source
    assert catalog.model("Mixtral-8x7B").is_moe and catalog.model("DeepSeek-V3").is_mla


def test_param_count_matches_published_llama_and_qwen():
    assert count_params(32, 4096, 32, 8, 128, 14336, 128256) == pytest.approx(8.030e9, rel=1e-3)
    assert count_params(28, 3584, 28, 4, 128, 18944, 152064, True) == pytest.approx(7.616e9,
                                                                                     rel=1e-3)


def test_weights_and_kv_bytes_by_hand(catalog):
    llama8 = catalog.model("Llama-3.1-8B")
    assert weight_bytes(llama8, "bf16") == pytest.approx(8.03e9 * 2)
    assert weight_bytes(llama8, "int4") == pytest.approx(8.03e9 * (0.5 + 4 / 128))
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131072 = 128 KiB
    assert kv_bytes_per_token(llama8, "bf16") == 131072
    assert kv_bytes_per_token(llama8, "fp8") == 65536
    # MLA: 61 layers x (512 + 64) x 2 bytes = 70272 (68.6 KiB), not split by TP
    ds = catalog.model("DeepSeek-V3")
    assert kv_bytes_per_token(ds, "bf16") == 61 * 576 * 2
    assert kv_bytes_per_token_per_gpu(ds, "bf16", 8, 1) == 61 * 576 * 2
    # GQA: 8 KV heads split over TP 4 -> a quarter; TP 16 would replicate (capped at 8)
    assert kv_bytes_per_token_per_gpu(llama8, "bf16", 4, 2) == 131072 / 2 / 4


def test_memory_plan_by_hand(catalog):
    m = plan_memory(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"), "bf16", "bf16",
                    context=2048, max_batched_tokens=2048)
    assert m.weights_gb == pytest.approx(16.06)
    assert m.usable_gb == pytest.approx(72.0)
    assert m.kv_gb == pytest.approx(72.0 - 16.06 - m.activations_gb - 3.5)
    assert m.kv_tokens == int(m.kv_gb * 1e9 // 131072)
    assert m.max_sequences == m.kv_tokens // 2048 and m.fits
    big = plan_memory(catalog.model("Llama-3.1-405B"), catalog.gpu("L4"), "bf16", "bf16")
    assert not big.fits and "weights need 811.7 GB" in big.reason


def test_allreduce_and_spec_formulas(catalog):
    h100 = catalog.gpu("H100 SXM")
    # NCCL ring: 3.6 us base + 2*(4-1) steps * 2.5 us (NVLink) + 2*(4-1)/4 * 1 MB / (450 GB/s * 0.5)
    assert allreduce_seconds(h100, 4, 1e6, 0.5) == pytest.approx(18.6e-6 + 1.5 * 1e6 / 225e9)
    assert allreduce_seconds(h100, 1, 1e6, 0.5) == 0.0
    # PCIe steps cost 5.7 us: 3.6 + 2 * 5.7 = 15.0 us at TP2, plus 1 MB over 64 GB/s * 0.5
    pcie = catalog.gpu("H100 PCIe")
    assert allreduce_seconds(pcie, 2, 1e6, 0.5) == pytest.approx(15.0e-6 + 1e6 / 32e9)
    # a pipeline hand-off is one step: 3.6 + 2.5 us plus the message
    assert send_seconds(h100, 1e6, 0.5) == pytest.approx(6.1e-6 + 1e6 / 225e9)
    # (1 - 0.7^5) / 0.3 = 2.7731
    assert SpecDecode(4, 0.7).tokens_per_step == pytest.approx(2.7731, abs=1e-4)


def test_decode_is_bandwidth_bound_and_prefill_compute_bound(catalog):
    d = Deployment(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"))
    eff = Efficiency(flops=0.5, memory=0.8, overhead_ms=0.0, ridge_blend=0.0)
    cost = StepCost(d, eff)
    # decode of one sequence at 1000 cached tokens reads weights + KV:
    expected = (8.03e9 * 2 + 1001 * 131072) / (3350e9 * 0.8)
    assert cost.decode_seconds(1, 1000) == pytest.approx(expected, rel=1e-6)
    # a 2048-token prefill is compute bound: linear + lm_head + causal attention FLOPs
    active = 8.03e9 - 2 * 128256 * 4096
    flops = 2 * active * 2048 + 2 * 128256 * 4096 + 4 * 32 * 32 * 128 * 2048 * 1024
    assert cost.time(2048, 2048 * 1024, 0, 0, 1) == pytest.approx(flops / (989e12 * 0.5), rel=1e-6)


def test_a_catalog_gpus_step_adds_its_kernels_floor_and_the_ridge_blend(catalog):
    """Defaults: 0.3 ms of host time plus 50 us a layer, and the GEMMs' time is the longer of
    compute and reading plus half the shorter. A device measured here keeps its measured step
    and the plain roofline its figures were fitted to."""
    d = Deployment(catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM"))
    plain = StepCost(d, Efficiency(overhead_ms=0.0, ridge_blend=0.0))
    cost = StepCost(d, Efficiency())
    read = 8.03e9 * 2 / (3350e9 * 0.8)
    gemm = (2 * (8.03e9 - 2 * 128256 * 4096) + 2 * 128256 * 4096) / (989e12 * 0.5)
    assert cost.decode_seconds(1, 0) - plain.decode_seconds(1, 0) == pytest.approx(
        0.3e-3 + 32 * 50e-6 + 0.5 * gemm, rel=1e-6)
    assert plain.decode_seconds(1, 0) == pytest.approx(read + 131072 / (3350e9 * 0.8), rel=1e-6)
    here = dataclasses.replace(catalog.gpu("H100 SXM"), step_overhead_ms=2.0)
    measured = StepCost(Deployment(d.model, here), Efficiency())
    assert measured.decode_seconds(1, 0) - plain.decode_seconds(1, 0) == pytest.approx(2e-3)


def test_linear_and_attention_rooflines_add(catalog):
    """70B fp8 on 4 x H100 at batch 256: the GEMMs are compute bound, attention is KV bound, and
    the two kernels' times add, plus 160 all-reduces of 256 tokens."""
    d = Deployment(catalog.model("Llama-2-70B"), catalog.gpu("H100 SXM"), "fp8", "fp8", tp=4)
    eff = Efficiency(flops=0.5, memory=0.8, link=0.7, overhead_ms=0.0, ridge_blend=0.0)
    cost = StepCost(d, eff)
    active = 68.98e9 - 2 * 32000 * 8192
    gemm = (256 * 2 * active + 256 * 2 * 32000 * 8192) / (4 * 1979e12 * 0.5)
    weights = 68.98e9 / 4 / (3350e9 * 0.8)
    kv_per_token = 2 * 80 * 8 * 128 * 1.0 / 4
    kv = (256 * 1000 + 256) * kv_per_token / (3350e9 * 0.8)
    # attention FLOPs run at the bf16 rate, not fp8's
    attn = 4 * 80 * 64 * 128 * 256 * 1000 / (4 * 989e12 * 0.5)
    assert gemm > weights and kv > attn
    comm = 160 * (18.6e-6 + 1.5 * 256 * 2 * 8192 / (450e9 * 0.7))
    assert cost.decode_seconds(256, 1000) == pytest.approx(gemm + kv + comm, rel=1e-6)


def test_moe_decode_reads_only_touched_experts(catalog):
    d = Deployment(catalog.model("Mixtral-8x7B"), catalog.gpu("H100 SXM"))
    cost = StepCost(d, Efficiency(overhead_ms=0.0))
    one, many = cost.decode_seconds(1, 0), cost.decode_seconds(64, 0)
    assert 0.2 < one / many < 0.45  # 2 of 8 experts at batch 1, nearly all at 64


def test_costs_by_hand(catalog):
    h100 = catalog.gpu("H100 SXM")
    opts = CostOptions(spot_share=0.5, interruption_overhead=0.1)
    assert gpu_hour_price(h100, opts) == pytest.approx(0.5 * 2.95 + 0.5 * 2.69 * 1.1)
    assert gpu_hour_price(catalog.gpu("A100 40GB"), opts) == 1.29  # no spot offer
    assert cost_per_million(3.6, 1000.0) == pytest.approx(1.0)
    assert autoscaled_cost(h100, 2, [1, 3], CostOptions()) == pytest.approx(2.95 * 2 * 2)


def test_unknown_names_suggest_closest(catalog):
    with pytest.raises(UnknownNameError, match="Llama-3.1-70B"):
        catalog.model("llama-3.1-7b")
    with pytest.raises(UnknownNameError, match="H100"):
        catalog.gpu("H10")


def test_user_catalog_overrides_and_malformed_names_file_and_field(tmp_path):
    (tmp_path / "catalogs").mkdir()
    prices = tmp_path / "catalogs" / "prices.toml"
    prices.write_text('[price."H100 SXM"]\non_demand = 1.5\nsource = "my deal"\n'
                      'date = "2026-01-01"\n')
    assert load_catalog(tmp_path).gpu("H100 SXM").on_demand == 1.5
    gpus = tmp_path / "catalogs" / "gpus.toml"
    gpus.write_text('[gpu."H100 SXM"]\nmemory_gb = "lots"\n')
    with pytest.raises(CatalogError, match=r"gpus.toml.*H100 SXM.*memory_gb"):
        load_catalog(tmp_path)
    gpus.write_text('[gpu."X1"]\nmemory_gb = 10\n')
    with pytest.raises(CatalogError, match=r"gpus.toml.*X1.*missing field"):
        load_catalog(tmp_path)


def test_hf_config_import_moe(tmp_path):
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
              "num_local_experts": 8, "num_experts_per_tok": 2, "model_type": "mixtral"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    m = model_from_hf_config(path, "mixtral")
    assert m.params_b == pytest.approx(46.70, rel=2e-3)
    assert m.active_params_b == pytest.approx(12.88, rel=2e-3)
    path.write_text(json.dumps({**config, "hidden_size": "big"}))
    with pytest.raises(CatalogError, match="hidden_size"):
        model_from_hf_config(path)


def test_calibration_fit_recovers_known_efficiency(catalog):
    truth = Efficiency(flops=0.5, memory=0.7)
    runs = []
    for batch, inp, out in ((1, 128, 128), (64, 2048, 128), (32, 128, 1024)):
        m = Measurement("Llama-3.1-8B", "H100 SXM", "bf16", "bf16", 1, 1, batch, inp, out, 1.0)
        d = Deployment(catalog.model(m.model), catalog.gpu(m.gpu), max_seqs=batch)
        tput = predict(d, m, truth)["throughput_tok_s"]
        runs.append(Measurement(**{**m.__dict__, "throughput_tok_s": tput}))
    cal = fit(runs, catalog, "synthetic")
    eff = cal.efficiency("H100 SXM", "bf16")
    assert eff.flops == pytest.approx(0.5, abs=0.051)
    assert eff.memory == pytest.approx(0.7, abs=0.051)
    assert cal.fit_error_pct < 2.0 and isinstance(cal, Calibration)
