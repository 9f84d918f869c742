"""The planner's Kubernetes manifests: data written by PyYAML, read back, and checked against the
Kubernetes API schema (kubernetes-validate's bundled OpenAPI schemas, strict: unknown fields fail).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from planner.catalog import load_catalog
from planner.export import kubernetes_manifests, kubernetes_yaml, vllm_command
from planner.kubernetes import HPA_METRIC, VLLM_VERSION, nodes_for
from planner.search import SearchSpace, search
from planner.timing import SpecDecode
from planner.workload import Slo, Workload

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')")
K8S = "1.33.0"  # a version every current managed Kubernetes runs
W = Workload(500, 100, rate=4, slo=Slo(3000, 60), num_requests=200)


@pytest.fixture(scope="module")
def plans():
    catalog = load_catalog()

    def first(model, **space):
        space = {"max_seqs": (64,), "spec": (None,), "pp": (1,), **space}
        return search(catalog.model(model), W, catalog, SearchSpace(**space)).candidates[0]

    return {
        "one node": first("Llama-3.1-70B", gpus=("H100 SXM",), weights=("fp8",), kv=("fp8",),
                          tp=(2,)),
        "speculative": first("Llama-3.1-8B", gpus=("H100 SXM",), weights=("bf16",),
                             kv=("bf16",), tp=(1,), spec=(SpecDecode(4, method="ngram"),)),
        "two nodes": first("Llama-3.1-405B", gpus=("H100 SXM",), weights=("bf16",),
                           kv=("bf16",), tp=(8,), pp=(2,)),
    }


def _validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S, strict=True)


def _pod_template(template: dict) -> dict:
    """A LeaderWorkerSet template as a core v1 PodTemplate (the CRD's schema is not bundled)."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
            "template": template}


@pytest.mark.parametrize("which", ["one node", "speculative", "two nodes"])
def test_manifests_read_back_and_match_the_kubernetes_schema(plans, which):
    plan = plans[which]
    assert ("--speculative-config" in vllm_command(plan)) == (which == "speculative")
    objects = kubernetes_manifests(plan)
    text = kubernetes_yaml(plan)
    assert list(yaml.safe_load_all(text)) == json.loads(json.dumps(objects))
    kinds = [o["kind"] for o in objects]
    wide = nodes_for(plan.deployment.gpus) > 1
    assert kinds == ["LeaderWorkerSet" if wide else "Deployment", "Service",
                     "HorizontalPodAutoscaler", "ConfigMap"]
    for obj in objects[1:]:
        _validate(obj)
    workload = objects[0]
    if wide:
        spec = workload["spec"]["leaderWorkerTemplate"]
        assert spec["size"] == 2 and workload["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        templates = [spec["leaderTemplate"], spec["workerTemplate"]]
        for t in templates:
            _validate(_pod_template(t))
        leader = spec["leaderTemplate"]["spec"]["containers"][0]
        # The leader runs the very command vLLM's parser checks, after Ray's head is up.
        assert leader["command"][:2] == ["sh", "-c"]
        assert leader["command"][2].endswith("&& exec " + vllm_command(plan))
        assert objects[1]["spec"]["selector"]["role"] == "leader"
    else:
        _validate(workload)
        templates = [workload["spec"]["template"]]
        container = templates[0]["spec"]["containers"][0]
        assert shlex.join(["vllm", "serve", *container["args"]]) == vllm_command(plan)
        assert workload["spec"]["replicas"] == plan.replicas
    for t in templates:
        pod = t["spec"]
        c = pod["containers"][0]
        assert c["image"] == f"vllm/vllm-openai:v{VLLM_VERSION}"
        assert c["resources"]["limits"]["nvidia.com/gpu"] * (2 if wide else 1) \
            == plan.deployment.gpus
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    served = templates[0]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert served[probe]["httpGet"] == {"path": "/health", "port": 8000}
    assert objects[2]["spec"]["scaleTargetRef"]["kind"] == workload["kind"]


def test_the_hpa_metric_is_served_by_the_shipped_adapter_rule(plans):
    objects = kubernetes_manifests(plans["one node"])
    hpa, rules = objects[2], objects[3]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == HPA_METRIC
    rule, = yaml.safe_load(rules["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == HPA_METRIC
    # The series it asks Prometheus for is one real vLLM serves (a scrape of vLLM 0.32).
    scraped = (Path(__file__).parents[1] / "monitor" / "vllm_metrics_a.txt").read_text()
    series = rule["seriesQuery"].split("{", 1)[0]
    assert f"\n{series}{{" in scraped
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_the_schema_check_is_not_vacuous(plans):
    deployment = kubernetes_manifests(plans["one node"])[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)


def test_a_replica_spans_the_fewest_equal_nodes():
    assert [nodes_for(g) for g in (1, 8, 9, 10, 16, 24)] == [1, 1, 3, 2, 2, 3]
