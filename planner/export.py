"""Exports for a chosen plan: vLLM and SGLang commands, Kubernetes YAML, ranking CSV / JSON."""

from __future__ import annotations

import csv
import io
import json
import shlex

from planner.search import Plan

VLLM_QUANT = {"fp8": "fp8", "int8": "compressed-tensors", "int4": "awq"}
SGLANG_KV = {"fp8": "fp8_e4m3"}


def _model_id(plan: Plan) -> str:
    m = plan.deployment.model
    return m.hf_id or m.name


def vllm_command(plan: Plan, prefix_caching: bool = True) -> str:
    """A `vllm serve` command line for one replica of the plan."""
    d = plan.deployment
    args = ["vllm", "serve", _model_id(plan), "--tensor-parallel-size", str(d.tp),
            "--pipeline-parallel-size", str(d.pp), "--max-num-seqs", str(d.max_seqs),
            "--max-num-batched-tokens", str(d.max_batched_tokens)]
    if d.weights in VLLM_QUANT:
        args += ["--quantization", VLLM_QUANT[d.weights]]
    if d.kv == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if d.spec is not None:
        spec = {"method": d.spec.method, "num_speculative_tokens": d.spec.draft_len}
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return shlex.join(args)


def sglang_command(plan: Plan, prefix_caching: bool = True) -> str:
    """An SGLang `launch_server` command line for one replica of the plan."""
    d = plan.deployment
    args = ["python", "-m", "sglang.launch_server", "--model-path", _model_id(plan),
            "--tp-size", str(d.tp), "--pp-size", str(d.pp),
            "--max-running-requests", str(d.max_seqs)]
    if d.weights in VLLM_QUANT:
        args += ["--quantization", VLLM_QUANT[d.weights]]
    if d.kv in SGLANG_KV:
        args += ["--kv-cache-dtype", SGLANG_KV[d.kv]]
    if not prefix_caching:
        args.append("--disable-radix-cache")
    if d.spec is not None:
        args += ["--speculative-algorithm", d.spec.method.upper(),
                 "--speculative-num-steps", str(d.spec.draft_len),
                 "--speculative-num-draft-tokens", str(d.spec.draft_len + 1)]
    return shlex.join(args)


def kubernetes_yaml(plan: Plan, name: str = "llm-server", image: str = "vllm/vllm-openai:latest",
                    max_replicas: int | None = None) -> str:
    """A Deployment running the vLLM command and an HPA scaling it on GPU-hours' worth of load."""
    d = plan.deployment
    serve = vllm_command(plan).split(" ", 2)[2]  # the image's entrypoint is `vllm serve`
    args = json.dumps(shlex.split(serve))
    top = max_replicas or max(plan.replicas * 2, plan.replicas + 1)
    return f"""apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
  labels: {{app: {name}}}
spec:
  replicas: {plan.replicas}
  selector:
    matchLabels: {{app: {name}}}
  template:
    metadata:
      labels: {{app: {name}}}
    spec:
      containers:
        - name: server
          image: {image}
          args: {args}
          ports: [{{containerPort: 8000}}]
          resources:
            limits: {{nvidia.com/gpu: {d.gpus}}}
          readinessProbe:
            httpGet: {{path: /health, port: 8000}}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {name}
spec:
  scaleTargetRef: {{apiVersion: apps/v1, kind: Deployment, name: {name}}}
  minReplicas: 1
  maxReplicas: {top}
  metrics:
    - type: Pods
      pods:
        metric: {{name: vllm_num_requests_running}}
        target: {{type: AverageValue, averageValue: "{max(1, int(d.max_seqs * 0.8))}"}}
"""


def ranking_csv(plans: list[Plan]) -> str:
    """The ranked plans as CSV, one row each, columns as in Plan.as_dict()."""
    rows = [_flat(p.as_dict()) for p in plans]
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()


def ranking_json(plans: list[Plan]) -> str:
    return json.dumps([p.as_dict() for p in plans], indent=2)


def _flat(row: dict) -> dict:
    spec = row.pop("spec_decode")
    row["spec_decode"] = "" if spec is None else f"{spec['method']}:{spec['draft_len']}"
    return row
