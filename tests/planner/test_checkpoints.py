"""Plans name what they need to run: a quantized checkpoint, a draft model, or are not offered."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest

from planner.catalog import load_catalog
from planner.checkpoints import servable, speculation_for, weights_for
from planner.export import NotServable, sglang_command, vllm_command
from planner.search import SearchSpace, search
from planner.timing import Deployment, SpecDecode
from planner.workload import Slo, Workload


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _cmd(d: Deployment) -> list[str]:
    return shlex.split(vllm_command(SimpleNamespace(deployment=d)))


def test_quantized_weights_name_a_checkpoint_that_carries_them(catalog):
    model, gpu = catalog.model("Llama-3.1-8B"), catalog.gpu("H100 SXM")
    int4 = _cmd(Deployment(model, gpu, weights="int4"))
    assert int4[2] == "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4"
    assert "--quantization" not in int4  # vLLM reads the method from the checkpoint
    fp8 = _cmd(Deployment(model, gpu, weights="fp8"))
    assert fp8[2] == "meta-llama/Llama-3.1-8B-Instruct" and fp8[fp8.index(
        "--quantization") + 1] == "fp8"
    assert "an int8 checkpoint" in weights_for(catalog.model("Llama-2-7B"), "int8")
    # DeepSeek-V3's own checkpoint is fp8: no flag, and bf16 is not something it ships.
    assert weights_for(catalog.model("DeepSeek-V3"), "fp8").quantization is None
    assert isinstance(weights_for(catalog.model("DeepSeek-V3"), "bf16"), str)


def test_speculative_methods_name_their_draft_or_need_none(catalog):
    gpu = catalog.gpu("H100 SXM")
    d = servable(Deployment(catalog.model("Llama-3.1-8B"), gpu, spec=SpecDecode()))
    config = json.loads(_cmd(d)[_cmd(d).index("--speculative-config") + 1])
    assert config == {"method": "eagle", "num_speculative_tokens": 4,
                      "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"}
    assert "--speculative-draft-model-path yuhuili/EAGLE-LLaMA3.1-Instruct-8B" in \
        sglang_command(SimpleNamespace(deployment=d))
    mtp = speculation_for(catalog.model("DeepSeek-V3"), SpecDecode())
    assert (mtp.method, mtp.draft) == ("deepseek_mtp", "")
    assert "needs a draft model" in speculation_for(catalog.model("Qwen2.5-7B"), SpecDecode())
    ngram = speculation_for(catalog.model("Qwen2.5-7B"), SpecDecode(method="ngram"))
    assert ngram.method == "ngram"
    assert "pipeline parallelism" in servable(
        Deployment(catalog.model("Llama-3.1-8B"), gpu, pp=2, spec=SpecDecode()))
    with pytest.raises(NotServable, match="needs a draft model"):
        vllm_command(SimpleNamespace(deployment=Deployment(catalog.model("Qwen2.5-7B"), gpu,
                                                           spec=SpecDecode())))


def test_a_search_offers_only_what_runs_and_says_what_it_left_out(catalog):
    w = Workload(500, 100, rate=2, slo=Slo(3000, 80), num_requests=100)
    space = SearchSpace(gpus=("H100 SXM",), weights=("bf16", "int8"), kv=("bf16",), tp=(2, 4),
                        pp=(1, 2), max_seqs=(64,))
    result = search(catalog.model("Llama-2-13B"), w, catalog, space)
    assert result.evaluated == 2 * 2 * 2 * 2  # every combination is still counted
    assert all(p.deployment.weights == "bf16" for p in result.candidates)
    assert all(p.deployment.spec is None or p.deployment.pp == 1 for p in result.candidates)
    assert any("int8 weights of Llama-2-13B" in n for n in result.notes)
    assert any("pipeline parallelism" in n for n in result.notes)
    for p in result.candidates:
        vllm_command(p)  # every offered plan exports


def test_every_listed_name_says_how_it_was_checked_and_unchecked_ones_are_not_offered(catalog):
    from dataclasses import replace

    from planner import checkpoints

    entries = list(checkpoints.QUANTIZED.values()) + list(checkpoints.DRAFTS.values())
    assert all(e.checked and checkpoints.CHECKED_ON in e.checked for e in entries)
    key = ("Llama-3.1-8B", "int4")
    listed = checkpoints.QUANTIZED[key]
    checkpoints.QUANTIZED[key] = replace(listed, checked="")
    try:
        why = weights_for(catalog.model("Llama-3.1-8B"), "int4")
    finally:
        checkpoints.QUANTIZED[key] = listed
    assert isinstance(why, str) and "unverified" in why and listed.hf_id in why
    draft = checkpoints.DRAFTS["Llama-3.1-8B"]
    checkpoints.DRAFTS["Llama-3.1-8B"] = replace(draft, checked="")
    try:
        why = speculation_for(catalog.model("Llama-3.1-8B"), SpecDecode())
    finally:
        checkpoints.DRAFTS["Llama-3.1-8B"] = draft
    assert isinstance(why, str) and "unverified" in why
