"""Exports for a chosen plan: vLLM and SGLang commands, Kubernetes YAML, ranking CSV."""

from __future__ import annotations

import csv
import io
import json
import re
import shlex
from collections.abc import Callable
from types import SimpleNamespace

from planner import kubernetes
from planner.checkpoints import Weights, cp_servable, speculation_for, weights_for
from planner.disagg import DisaggPlan
from planner.kubernetes import VLLM_IMAGE
from planner.search import Plan
from planner.timing import SpecDecode

SGLANG_KV = {"fp8": "fp8_e4m3"}
SGLANG_SPEC = {"eagle": "EAGLE", "eagle3": "EAGLE3", "deepseek_mtp": "EAGLE", "ngram": "NGRAM"}


class NotServable(ValueError):
    """A plan no server can run as it stands (a checkpoint or draft model is missing)."""


# A word naming a shell variable, with an optional port: what a multi-node command leaves to
# each node's shell (its rank, the first node's address).
_SHELL_VARIABLE = re.compile(r"\$[A-Z_][A-Z0-9_]*(:\d+)?")


def shell_join(words: list[str]) -> str:
    """shlex.join, except that a word naming a shell variable stays expandable (double-quoted
    where shlex would single-quote it)."""
    return " ".join(f'"{w}"' if _SHELL_VARIABLE.fullmatch(w) else shlex.quote(w) for w in words)


def command_or_reason(render: Callable[[object], str], plan: object) -> str:
    """render(plan), or where that server cannot run the plan a shell comment saying why."""
    try:
        return render(plan)
    except NotServable as exc:
        return f"# Not offered: {exc}."


def _weights(plan: Plan) -> Weights:
    weights = weights_for(plan.deployment.model, plan.deployment.weights)
    if isinstance(weights, str):
        raise NotServable(weights)
    return weights


def _spec(plan: Plan) -> SpecDecode | None:
    d = plan.deployment
    if d.spec is None:
        return None
    spec = speculation_for(d.model, d.spec)
    if isinstance(spec, str):
        raise NotServable(spec)
    return spec


def vllm_speculative_config(spec: SpecDecode) -> dict:
    """vLLM's --speculative-config for one speculative method."""
    config: dict = {"method": spec.method, "num_speculative_tokens": spec.draft_len}
    if spec.draft:
        config["model"] = spec.draft
    if spec.method == "ngram":  # look up at most as many tokens as it proposes
        config["prompt_lookup_max"] = spec.draft_len
    return config


def max_model_len(plan: Plan) -> int:
    """The context to start the server with: what the plan's memory was sized for, when that
    is below the model's own (vLLM refuses to start if its KV cache cannot hold one request
    of --max-model-len, which defaults to the model's whole context); 0 to leave the default."""
    memory = getattr(plan, "memory", None)
    context = getattr(memory, "context", 0)
    return context if 0 < context < plan.deployment.model.max_context else 0


def vllm_command(plan: Plan, prefix_caching: bool = True) -> str:
    """A `vllm serve` command line for one replica of the plan (NotServable if none can run:
    the search offers no such plan)."""
    d = plan.deployment
    weights = _weights(plan)
    args = ["vllm", "serve", weights.model_id, "--tensor-parallel-size", str(d.tp),
            "--pipeline-parallel-size", str(d.pp), "--max-num-seqs", str(d.max_seqs),
            "--max-num-batched-tokens", str(d.max_batched_tokens)]
    if weights.quantization:
        args += ["--quantization", weights.quantization]
    if d.kv == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if d.dcp > 1:
        args += ["--decode-context-parallel-size", str(d.dcp)]
    if d.cp > 1:
        # vLLM 0.32 checks each attention backend's supports_pcp: only the MLA implementation
        # sets it (vllm/v1/attention/backend.py, vllm/v1/worker/cp_utils.py).
        if not d.model.is_mla:
            raise NotServable(f"vLLM 0.32 runs prefill context parallelism on MLA attention "
                              f"only, not {d.model.name}'s")
        args += ["--prefill-context-parallel-size", str(d.cp)]
    if max_model_len(plan):
        args += ["--max-model-len", str(max_model_len(plan))]
    args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    spec = _spec(plan)
    if spec is not None:
        args += ["--speculative-config",
                 json.dumps(vllm_speculative_config(spec), separators=(",", ":"))]
    return shlex.join(args)


# How `servescope serve` spells the planner's precisions (engine/engine_config.py).
SERVESCOPE_WEIGHTS = {"bf16": ["--dtype", "bfloat16"], "fp16": ["--dtype", "float16"],
                      "int8": ["--dtype", "bfloat16", "--weights", "int8"],
                      "int4": ["--dtype", "bfloat16", "--weights", "int4"]}
SERVESCOPE_KV = {"bf16": [], "fp16": [], "fp8": ["--kv-cache-dtype", "fp8"],
                 "int8": ["--kv-cache-dtype", "int8"]}


def servescope_serve_args(plan: Plan, prefix_caching: bool = True,
                          sized_context: bool = True) -> list[str]:
    """The plan's settings as `servescope serve` flags (model and port left to the caller);
    NotServable says what the embedded engine cannot run (it serves one device, no fp8
    weights, and speculates by prompt lookup or the demo model's own draft)."""
    d = plan.deployment
    if d.gpus > 1 or d.dcp > 1:
        raise NotServable(f"servescope serve runs on one device; this plan shards the model "
                          f"over {d.gpus} ({d.layout}): run it with vLLM or SGLang")
    if d.weights not in SERVESCOPE_WEIGHTS:
        raise NotServable(f"servescope serve has no {d.weights} weights: plan with bf16, int8 "
                          "or int4")
    args = [*SERVESCOPE_WEIGHTS[d.weights], *SERVESCOPE_KV[d.kv], "--max-num-seqs",
            str(d.max_seqs), "--max-num-batched-tokens", str(d.max_batched_tokens)]
    if sized_context and max_model_len(plan):
        args += ["--max-model-len", str(max_model_len(plan))]
    if prefix_caching:
        args.append("--prefix-caching")
    if d.spec is not None:
        if d.spec.method != "ngram":
            raise NotServable(f"servescope serve has no {d.spec.method} speculation for "
                              f"{d.model.name}: plan with n-gram speculation or none")
        args += ["--spec", f"ngram:k={d.spec.draft_len}"]
    return args


def servescope_command(plan: Plan, model: str = "", prefix_caching: bool = True) -> str:
    """A `servescope serve` command line for the plan, on `model` (a GGUF or folder path;
    default the model's Hugging Face id)."""
    return shlex.join(["servescope", "serve", "--model", model or plan.deployment.model.hf_id,
                       *servescope_serve_args(plan, prefix_caching)])


# vLLM's NIXL connector moves the KV cache GPU to GPU (vllm/distributed/kv_transfer/kv_connector/
# v1/nixl); "kv_both" lets an instance send and receive, as vLLM's disaggregation examples run
# both sides. The proxy in front sends each request to a prefill instance with max_tokens 1, then
# to a decode instance with the prefill's kv_transfer_params.
NIXL_KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def disagg_vllm_commands(plan: DisaggPlan) -> dict[str, str]:
    """`vllm serve` for one prefill and one decode instance of a disaggregated plan, each with
    its own layout and the NIXL KV-transfer config."""
    transfer = ["--kv-transfer-config", json.dumps(NIXL_KV_TRANSFER, separators=(",", ":"))]
    dd = plan.deployment
    memory = SimpleNamespace(context=plan.context)  # both pools take the same requests
    return {role: shlex.join(shlex.split(vllm_command(SimpleNamespace(deployment=d,
                                                                      memory=memory)))
                             + transfer)
            for role, d in (("prefill", dd.prefill), ("decode", dd.decode))}


def sglang_command(plan: Plan, prefix_caching: bool = True) -> str:
    """An SGLang `launch_server` command line for one replica of the plan."""
    d = plan.deployment
    # SGLang's decode context parallelism stripes MLA caches only (its docs,
    # advanced_features/dcp: "--dcp-size N").
    if d.dcp > 1 and not d.model.is_mla:
        raise NotServable(f"SGLang's decode context parallelism covers MLA models only; "
                          f"{d.model.name} with dcp {d.dcp} runs on vLLM")
    weights = _weights(plan)
    # With attention context parallelism SGLang's --tp-size is the world of a pipeline stage
    # and --attn-cp-size splits it (arg_groups/parallel_hook.py: tp_size % attn_cp_size == 0).
    args = ["python", "-m", "sglang.launch_server", "--model-path", weights.model_id,
            "--tp-size", str(d.tp * d.cp), "--pp-size", str(d.pp),
            "--max-running-requests", str(d.max_seqs)]
    if d.cp > 1:  # zigzag balances the causal work between the ranks
        why = cp_servable(d.model)
        if why:
            raise NotServable(why)
        args += ["--attn-cp-size", str(d.cp), "--enable-prefill-cp", "--cp-strategy", "zigzag"]
    if weights.quantization:
        args += ["--quantization", weights.quantization]
    if d.kv in SGLANG_KV:
        args += ["--kv-cache-dtype", SGLANG_KV[d.kv]]
    if d.dcp > 1:
        args += ["--dcp-size", str(d.dcp)]
    if max_model_len(plan):
        args += ["--context-length", str(max_model_len(plan))]
    if not prefix_caching:
        args.append("--disable-radix-cache")
    spec = _spec(plan)
    if spec is not None:
        algorithm = SGLANG_SPEC.get(spec.method, spec.method.upper())
        args += ["--speculative-algorithm", algorithm]
        if spec.draft:
            args += ["--speculative-draft-model-path", spec.draft]
        args += ["--speculative-num-steps", str(spec.draft_len)]
        if algorithm.startswith("EAGLE"):
            # One chain of draft_len tokens: SGLang needs the branching factor whenever the
            # steps are given (without it, its resolution fails comparing None with 1).
            args += ["--speculative-eagle-topk", "1"]
        args += ["--speculative-num-draft-tokens", str(spec.draft_len + 1)]
    nodes = kubernetes.nodes_for(d.gpus)
    if nodes > 1:
        # Every node runs the same command with its own rank, all pointed at the first node
        # (SGLang's multi-node launch): left to each node's shell, as a job script's or an LWS
        # pod's environment would give them.
        args += ["--nnodes", str(nodes), "--node-rank", "$NODE_RANK",
                 "--dist-init-addr", "$LEADER_ADDR:20000"]
    return shell_join(args)


def kubernetes_manifests(plan: Plan, name: str = "llm-server", image: str = VLLM_IMAGE,
                         max_replicas: int | None = None) -> list[dict]:
    """The plan's Kubernetes objects as data (planner.kubernetes): a Deployment, or a
    LeaderWorkerSet for a replica wider than one node, with its Service, HPA and the Prometheus
    Adapter rule the HPA's metric needs."""
    serve_args = shlex.split(vllm_command(plan))[2:]  # the image's entrypoint is `vllm serve`
    return kubernetes.manifests(plan, serve_args, name, image, max_replicas)


def kubernetes_yaml(plan: Plan, name: str = "llm-server", image: str = VLLM_IMAGE,
                    max_replicas: int | None = None) -> str:
    """kubernetes_manifests() as YAML (PyYAML), behind comments saying what it needs."""
    objects = kubernetes_manifests(plan, name, image, max_replicas)
    wide = objects[0]["kind"] == "LeaderWorkerSet"
    return kubernetes.to_yaml(objects, kubernetes.header(name, wide))


def ranking_csv(plans: list[Plan]) -> str:
    """The ranked plans as CSV, one row each, columns as in Plan.as_dict()."""
    rows = [_flat(p.as_dict()) for p in plans]
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()


def _flat(row: dict) -> dict:
    spec = row.pop("spec_decode")
    row["spec_decode"] = "" if spec is None else f"{spec['method']}:{spec['draft_len']}"
    return row
