"""Every `vllm serve` and `sglang.launch_server` command the planner can emit, checked by the
real servers' own argument parsers and config checks (each in its own environment, as a
subprocess; skipped, saying why, without it)."""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.catalog import Model, load_catalog
from planner.checkpoints import DRAFTS, NATIVE, QUANTIZED
from planner.disagg import search_disagg
from planner.export import NotServable, disagg_vllm_commands, sglang_command, vllm_command
from planner.search import SearchSpace, enumerate_deployments, search, servable_only
from planner.timing import Deployment, SpecDecode
from planner.workload import Slo, Workload

HERE = Path(__file__).parent
# One worker for both servers' checks: they share the search (exportable()).
pytestmark = pytest.mark.xdist_group("exports")
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


@dataclass
class Exportable:
    """What the planner can emit commands for: every servable layout of every catalog model
    (GPU and batch limit do not change what the servers check), the plans of a catalog-wide
    search, and the disaggregated plans of a long-prompt search."""

    layouts: list
    plans: list
    disagg: list
    dropped: dict[str, int]
    cp: list  # prefill context parallel layouts, over nodes: vLLM serves the MLA ones only


@functools.cache
def exportable() -> Exportable:
    """Computed once per worker: both servers' checks read it (the search is most of their
    time)."""
    catalog = load_catalog()
    space = SearchSpace(gpus=("H100 SXM",), max_seqs=(64,),
                        spec=(None, SpecDecode(), SpecDecode(method="ngram")))
    layouts, plans, disagg = [], [], []
    dropped: dict[str, int] = {}
    for model in catalog.models.values():
        kept, why = servable_only(enumerate_deployments(model, catalog, space))
        for reason, n in why.items():
            dropped[reason] = dropped.get(reason, 0) + n
        layouts += [SimpleNamespace(deployment=d) for d in kept]
    w = Workload(800, 200, rate=4, slo=Slo(ttft_p99_ms=3000, tpot_p99_ms=80), num_requests=200)
    for model in catalog.models.values():
        result = search(model, w, catalog, SearchSpace(max_seqs=(64, 256)))
        plans += result.candidates + result.pareto
    # Disaggregated plans on one GPU type: the GPU changes nothing the servers check, and the
    # search over every type took most of this test.
    long = Workload(16384, 512, rate=1, slo=Slo(ttft_p99_ms=8000, tpot_p99_ms=30),
                    num_requests=200)
    for name in ("Llama-3.1-8B", "Llama-3.1-70B"):
        disagg += search_disagg(catalog.model(name), long, catalog,
                                SearchSpace(gpus=("H100 SXM",), max_seqs=(64, 256))).plans[:6]
    h100 = catalog.gpu("H100 SXM")
    cp = [SimpleNamespace(deployment=Deployment(catalog.model(name), h100, "fp8", "fp8", tp=tp,
                                                pp=pp, cp=n))
          for name in ("Llama-3.1-70B", "DeepSeek-V3") for tp, pp, n in ((8, 1, 2), (4, 2, 4))]
    return Exportable(layouts, plans, disagg, dropped, cp)


def on_node(command: str, rank: int = 0) -> str:
    """A multi-node command as the shell on node `rank` runs it (its rank and the first
    node's address filled in)."""
    return command.replace("$NODE_RANK", str(rank)).replace("$LEADER_ADDR", "10.0.0.1")


def every_command() -> tuple[list[str], dict[str, int]]:
    """The distinct `vllm serve` commands of everything exportable, disaggregated plans' both
    pools included (with the NIXL KV-transfer config)."""
    e = exportable()
    commands = {vllm_command(p) for p in e.layouts + e.plans}
    commands |= {vllm_command(p) for p in e.cp if p.deployment.model.is_mla}
    for plan in e.disagg:
        commands |= set(disagg_vllm_commands(plan).values())
    return sorted(commands), e.dropped


def every_sglang_command() -> tuple[list[str], dict[str, int]]:
    """The distinct SGLang commands of every layout and plan, and how many layouts the
    exporter refuses for SGLang, by reason (it raises NotServable, naming what SGLang lacks)."""
    e = exportable()
    commands: set[str] = set()
    refused: dict[str, int] = {}
    for plan in e.layouts + e.plans + e.cp:
        try:
            commands.add(on_node(sglang_command(plan)))
        except NotServable as exc:
            reason = str(exc).split(";")[0]
            refused[reason] = refused.get(reason, 0) + 1
    return sorted(commands), refused


def check_in(python: str, script: str, commands: list[str], tmp_path: Path) -> dict:
    """The server's own verdict on each command, from `script` run in its environment."""
    request = {"commands": [shlex.split(c) for c in commands],
               "folders": model_folders(tmp_path)}
    done = subprocess.run([python, str(HERE / script)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=900,
                          env={"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(server: str, commands: list[str], answer: dict, not_offered: dict) -> list:
    """The rejected commands; prints the count checked and rejected (the README quotes it).
    Those whose last check runs on CUDA only are counted apart, not as rejected."""
    results = list(zip(commands, answer["results"], strict=True))
    rejected = [(c, r["stage"], r["error"]) for c, r in results
                if not r["ok"] and r["stage"] != "cuda_only"]
    cuda_only = sum(r["stage"] == "cuda_only" for _, r in results)
    print(f"\n{server}: {len(commands)} commands checked, {len(rejected)} rejected, "
          f"{cuda_only} parsed but resolvable only on CUDA; not offered: {not_offered}",
          file=sys.stderr)
    kinds: dict[str, int] = {}
    for _cmd, stage, err in rejected:
        key = f"{stage}: {err.splitlines()[-1] if err else ''}"[:160]
        kinds[key] = kinds.get(key, 0) + 1
    print("\n".join(f"  {n} x {k}" for k, n in kinds.items()), file=sys.stderr)
    return rejected


def test_every_exported_vllm_command_passes_vllms_parser_and_config(vllm_python, tmp_path):
    commands, dropped = every_command()
    answer = check_in(vllm_python, "vllm_accepts.py", commands, tmp_path)
    rejected = report(f"vLLM {answer['vllm']}", commands, answer, dropped)
    assert len(commands) > 500
    # Only the prefill-context-parallel commands stop short of the last check here (vLLM's
    # V2 model runner, which runs PCP, needs Triton), and all of them do.
    cuda_only = {c for c, r in zip(commands, answer["results"], strict=True)
                 if r["stage"] == "cuda_only"}
    pcp = {c for c in commands if "--prefill-context-parallel-size" in c}
    assert pcp and cuda_only == pcp
    assert not rejected, "\n".join(f"{stage}: {cmd}\n  {err}" for cmd, stage, err in rejected[:8])


def test_every_exported_sglang_command_passes_sglangs_parser_and_checks(sglang_python,
                                                                       tmp_path):
    """SGLang's own argument parser and resolution (resolve_once, check_server_args) accept
    every `sglang.launch_server` command the planner emits (tests/planner/sglang_accepts.py;
    resolved on the CPU device: SGLang refuses to resolve without an accelerator)."""
    commands, refused = every_sglang_command()
    answer = check_in(sglang_python, "sglang_accepts.py", commands, tmp_path)
    rejected = report(f"SGLang {answer['sglang']}", commands, answer, refused)
    assert len(commands) > 300
    # Only GPTQ checkpoints stop short of the last check here, and all of them do.
    cuda_only = {c for c, r in zip(commands, answer["results"], strict=True)
                 if r["stage"] == "cuda_only"}
    gptq_ids = {f"--model-path {c.hf_id} " for c in QUANTIZED.values() if c.method == "gptq"}
    gptq = {c for c in commands if any(i in c for i in gptq_ids)}
    assert gptq and cuda_only == gptq
    assert not rejected, "\n".join(f"{stage}: {cmd}\n  {err}" for cmd, stage, err in rejected[:8])


def test_a_wrong_command_is_rejected_by_each_servers_check(vllm_python, sglang_python,
                                                           tmp_path):
    """The checks can fail: vLLM refuses a quantization the checkpoint does not carry and a
    tensor-parallel size that does not divide the attention heads; SGLang an unknown
    quantization and speculative decoding with pipeline parallelism. (vLLM 0.32's config
    classes accept n-gram speculation with pipeline parallelism; the planner never offers it.)"""
    vllm = ["vllm serve meta-llama/Llama-3.1-8B-Instruct --quantization awq",
            "vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 3"]
    for sub in ("v", "s"):
        (tmp_path / sub).mkdir()
    answer = check_in(vllm_python, "vllm_accepts.py", vllm, tmp_path / "v")
    assert [r["ok"] for r in answer["results"]] == [False, False]
    sglang = ["python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
              "--quantization bogus",
              "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
              "--pp-size 2 --speculative-algorithm EAGLE --speculative-draft-model-path "
              f"{DRAFTS['Llama-3.1-8B'].hf_id}"]
    answer = check_in(sglang_python, "sglang_accepts.py", sglang, tmp_path / "s")
    assert [r["ok"] for r in answer["results"]] == [False, False], answer
