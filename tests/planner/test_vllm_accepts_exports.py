"""Every `vllm serve` command the planner can emit, checked by real vLLM's own argument parser
and config classes (in vLLM's environment, as a subprocess; skipped, saying why, without it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from planner.catalog import Model, load_catalog
from planner.checkpoints import DRAFTS, NATIVE, QUANTIZED
from planner.disagg import search_disagg
from planner.export import disagg_vllm_commands, vllm_command
from planner.search import SearchSpace, enumerate_deployments, search, servable_only
from planner.timing import SpecDecode
from planner.workload import Slo, Workload

HERE = Path(__file__).parent
ARCH = {"llama": ("LlamaForCausalLM", "llama"), "mixtral": ("MixtralForCausalLM", "mixtral"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"), "deepseek": ("DeepseekV3ForCausalLM",
                                                             "deepseek_v3")}
# What each quantization method's checkpoint carries in its config.json (as published).
QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False,
             "sym": True},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                        "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True}}}},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128]},
}


def _family(model: Model) -> str:
    hf = model.hf_id.lower()
    for key in ("mixtral", "qwen2", "deepseek"):
        if key in hf:
            return key
    return "llama"


def hf_config(model: Model) -> dict:
    """The config.json fields vLLM reads, from the catalog's architecture."""
    arch, model_type = ARCH[_family(model)]
    config = {"architectures": [arch], "model_type": model_type, "hidden_size": model.hidden,
              "intermediate_size": model.intermediate, "num_attention_heads": model.heads,
              "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim,
              "num_hidden_layers": model.layers, "vocab_size": model.vocab,
              "max_position_embeddings": model.max_context, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    if model.is_moe:
        config.update(num_local_experts=model.experts, n_routed_experts=model.experts,
                      num_experts_per_tok=model.experts_per_token,
                      moe_intermediate_size=model.moe_intermediate,
                      n_shared_experts=model.shared_experts,
                      first_k_dense_replace=model.layers - model.moe_layers)
    if model.is_mla:
        config.update(kv_lora_rank=model.kv_lora_rank, q_lora_rank=1536,
                      qk_rope_head_dim=model.qk_rope_dim, qk_nope_head_dim=128,
                      v_head_dim=128, num_nextn_predict_layers=1, n_group=8, topk_group=4,
                      topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                      routed_scaling_factor=2.5)
    if NATIVE.get(model.name) == "fp8":
        config["quantization_config"] = QUANT_CONFIGS["fp8"]
    return config


def model_folders(tmp: Path) -> dict[str, str]:
    """A folder with a config.json for every model id a command can name: catalog models,
    their known quantized checkpoints (with the checkpoint's quantization_config) and drafts
    (one decoder layer of the target's shape, as EAGLE's are)."""
    catalog = load_catalog()
    configs: dict[str, dict] = {}
    for model in catalog.models.values():
        configs[model.hf_id or model.name] = hf_config(model)
    for (name, _precision), checkpoint in QUANTIZED.items():
        configs[checkpoint.hf_id] = {**hf_config(catalog.model(name)),
                                     "quantization_config": QUANT_CONFIGS[checkpoint.method]}
    for name, draft in DRAFTS.items():
        configs[draft.hf_id] = {**hf_config(catalog.model(name)), "num_hidden_layers": 1}
    folders = {}
    for i, (hf_id, config) in enumerate(sorted(configs.items())):
        folder = tmp / f"m{i}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        folders[hf_id] = str(folder)
    return folders


def every_command() -> tuple[list[str], dict[str, int]]:
    """The distinct commands of every servable layout of every catalog model (GPU and batch
    limit do not change what vLLM checks), plus those of a catalog-wide search's plans."""
    catalog = load_catalog()
    space = SearchSpace(gpus=("H100 SXM",), max_seqs=(64,),
                        spec=(None, SpecDecode(), SpecDecode(method="ngram")))
    commands: set[str] = set()
    dropped: dict[str, int] = {}
    for model in catalog.models.values():
        kept, why = servable_only(enumerate_deployments(model, catalog, space))
        for reason, n in why.items():
            dropped[reason] = dropped.get(reason, 0) + n
        commands |= {vllm_command(SimpleNamespace(deployment=d)) for d in kept}
    w = Workload(800, 200, rate=4, slo=Slo(ttft_p99_ms=3000, tpot_p99_ms=80), num_requests=200)
    for model in catalog.models.values():
        result = search(model, w, catalog, SearchSpace(max_seqs=(64, 256)))
        commands |= {vllm_command(p) for p in result.candidates + result.pareto}
    # Both pools of disaggregated plans, with the NIXL KV-transfer config (on one GPU type: the
    # GPU changes nothing vLLM checks, and the search over every type took most of this test).
    long = Workload(16384, 512, rate=1, slo=Slo(ttft_p99_ms=8000, tpot_p99_ms=30),
                    num_requests=200)
    for name in ("Llama-3.1-8B", "Llama-3.1-70B"):
        for plan in search_disagg(catalog.model(name), long, catalog,
                                  SearchSpace(gpus=("H100 SXM",), max_seqs=(64, 256))).plans[:6]:
            commands |= set(disagg_vllm_commands(plan).values())
    return sorted(commands), dropped


def test_every_exported_vllm_command_passes_vllms_parser_and_config(vllm_python, tmp_path):
    import shlex

    commands, dropped = every_command()
    request = {"commands": [shlex.split(c) for c in commands],
               "folders": model_folders(tmp_path)}
    done = subprocess.run([vllm_python, str(HERE / "vllm_accepts.py")], input=json.dumps(request),
                          capture_output=True, text=True, timeout=900,
                          env={"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    rejected = [(c, r["stage"], r["error"]) for c, r in zip(commands, answer["results"],
                                                           strict=True) if not r["ok"]]
    print(f"\nvLLM {answer['vllm']}: {len(commands)} commands checked, {len(rejected)} rejected; "
          f"not offered: {dropped}", file=sys.stderr)
    kinds: dict[str, int] = {}
    for _cmd, stage, err in rejected:
        key = f"{stage}: {err.splitlines()[-1] if err else ''}"[:160]
        kinds[key] = kinds.get(key, 0) + 1
    print("\n".join(f"  {n} x {k}" for k, n in kinds.items()), file=sys.stderr)
    assert len(commands) > 500
    assert not rejected, "\n".join(f"{stage}: {cmd}\n  {err}" for cmd, stage, err in rejected[:8])
