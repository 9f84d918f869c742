"""What a plan needs to exist before it can run: pre-quantized checkpoints and draft models.

vLLM quantizes fp8 on the fly; int8 and int4 weights come only from a checkpoint that carries
them (AWQ, GPTQ, compressed-tensors), and EAGLE needs a draft trained for the target. These
tables name the ones known (public Hugging Face repositories). Each entry says how its name was
checked (`checked`): the hub cannot be reached from where servescope is built, so the names were
looked up in stored copies of their Hugging Face pages (files, quantization tag, commit dates)
and, where vLLM's own source uses them, there too (checked 2026-12-01). `date` is the date the
hub page shows for the upload or the model card's release date (empty where the stored page
shows only "about a year ago"). An entry without a `checked`
note is not offered: the search says the checkpoint is unverified. A candidate that needs one
not listed is not offered either, and the search says what is missing. Add entries as they
appear, with how their names were checked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.catalog import Model
from planner.timing import Deployment, SpecDecode

ON_THE_FLY = {"fp8": "fp8"}  # weight precision -> vLLM --quantization that needs no checkpoint
CHECKED_ON = "2026-12-01"


@dataclass(frozen=True)
class Checkpoint:
    """A public checkpoint of a catalog model in one weight precision."""

    hf_id: str
    method: str  # the quant_method its config.json carries: awq, gptq, compressed-tensors, fp8
    source: str
    date: str
    checked: str = ""  # how the name was verified; empty: unverified, not offered


@dataclass(frozen=True)
class Draft:
    """A draft model for speculative decoding of one target (vLLM's `method`)."""

    hf_id: str
    method: str
    source: str
    date: str
    checked: str = ""


_HQ = "https://huggingface.co/hugging-quants"
_NM = "https://huggingface.co/neuralmagic"
_TB = "https://huggingface.co/TheBloke"
_QW = "https://huggingface.co/Qwen"
_EAGLE = "https://github.com/SafeAILab/EAGLE (README, released weights)"


def _hub(tags: str) -> str:
    return f"its Hugging Face page and file list ({tags}), stored copy, {CHECKED_ON}"


# (catalog model, weight precision) -> its checkpoint.
QUANTIZED: dict[tuple[str, str], Checkpoint] = {
    ("Llama-3.1-8B", "int4"): Checkpoint(
        "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "awq", _HQ, "2024-07-19",
        _hub("awq, 4-bit")),
    # w8a8: int8 weights and int8 activations (compressed-tensors).
    ("Llama-3.1-8B", "int8"): Checkpoint(
        "neuralmagic/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "compressed-tensors", _NM,
        "2024-07-11", _hub("compressed-tensors, 8-bit; card: release 7/11/2024")),
    ("Llama-3.1-70B", "int4"): Checkpoint(
        "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "awq", _HQ, "2024-07-19",
        _hub("awq, 4-bit; config.json quant_method awq, group 128")),
    ("Llama-3.1-70B", "int8"): Checkpoint(
        "neuralmagic/Meta-Llama-3.1-70B-Instruct-quantized.w8a8", "compressed-tensors", _NM,
        "2024-07-29", _hub("int8 weights and activations; card: release 7/29/2024")),
    ("Llama-3.1-405B", "int4"): Checkpoint(
        "hugging-quants/Meta-Llama-3.1-405B-Instruct-AWQ-INT4", "awq", _HQ, "2024-07-24",
        _hub("awq, 4-bit, 47 safetensors shards; README merged 2024-07-24")),
    ("Llama-2-7B", "int4"): Checkpoint(
        "TheBloke/Llama-2-7B-Chat-AWQ", "awq", _TB, "",
        _hub("awq, 4-bit, model.safetensors 3.89 GB")),
    ("Llama-2-13B", "int4"): Checkpoint(
        "TheBloke/Llama-2-13B-chat-AWQ", "awq", _TB, "2023-09-19",
        _hub("awq, 4-bit; README commits 2023-09-19")),
    ("Llama-2-70B", "int4"): Checkpoint(
        "TheBloke/Llama-2-70B-Chat-AWQ", "awq", _TB, "2023-09-19",
        _hub("awq, 4-bit; AWQ model commit 2023-09-19")),
    ("Mixtral-8x7B", "int4"): Checkpoint(
        "TheBloke/Mixtral-8x7B-Instruct-v0.1-AWQ", "awq", _TB, "",
        _hub("awq, 4-bit, 3 safetensors shards")),
    ("Qwen2.5-7B", "int4"): Checkpoint(
        "Qwen/Qwen2.5-7B-Instruct-AWQ", "awq", _QW, "2024-09-18", _hub("awq, 4-bit")),
    ("Qwen2.5-7B", "int8"): Checkpoint(
        "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "gptq", _QW, "2024-09-18",
        _hub("gptq, 8-bit; weights uploaded 2024-09-18")),
    ("Qwen2.5-72B", "int4"): Checkpoint(
        "Qwen/Qwen2.5-72B-Instruct-AWQ", "awq", _QW, "2024-09-18",
        _hub("awq, 4-bit; weights uploaded 2024-09-18")),
    ("Qwen2.5-72B", "int8"): Checkpoint(
        "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int8", "gptq", _QW, "2024-09-17",
        _hub("gptq, 8-bit; weights uploaded 2024-09-17")),
}

# Models whose own checkpoint is not bf16: their weights precision needs no flag, and bf16
# would need a converted checkpoint nobody publishes officially.
NATIVE: dict[str, str] = {"DeepSeek-V3": "fp8"}

# Catalog model -> EAGLE draft (vLLM `method: eagle`, `model: <draft>`).
DRAFTS: dict[str, Draft] = {
    "Llama-3.1-8B": Draft(
        "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "eagle",
        "vLLM examples/offline_inference/spec_decode.py; " + _EAGLE, "",
        "vLLM's examples/offline_inference/spec_decode.py (its default EAGLE draft); the "
        f"yuhuili models list on the hub, stored copy, {CHECKED_ON}"),
    "Llama-2-7B": Draft(
        "yuhuili/EAGLE-llama2-chat-7B", "eagle", _EAGLE, "2023-12-08",
        "vLLM's tests/neuron/2_core/test_eagle.py; " + _hub("commits 2023-12-08")),
    "Llama-2-13B": Draft("yuhuili/EAGLE-llama2-chat-13B", "eagle", _EAGLE, "2023-12-08",
                         _hub("commits 2023-12-08")),
    "Llama-2-70B": Draft("yuhuili/EAGLE-llama2-chat-70B", "eagle", _EAGLE, "2023-12-08",
                         _hub("commits 2023-12-08")),
}
# Known but not runnable: yuhuili/EAGLE-mixtral-instruct-8x7B (vLLM 0.32 has no
# EagleMixtralForCausalLM: "Model architectures ['EagleMixtralForCausalLM'] are not supported").
# Models that draft with their own multi-token-prediction layers (no separate draft model).
MTP: dict[str, str] = {"DeepSeek-V3": "deepseek_mtp"}
NEEDS_NO_DRAFT = ("ngram", "suffix")


@dataclass(frozen=True)
class Weights:
    """How a plan's weights are served: the model id to load and vLLM's --quantization."""

    model_id: str
    quantization: str | None  # None: none, or read from the checkpoint's own config


def model_id(model: Model) -> str:
    return model.hf_id or model.name


def weights_for(model: Model, precision: str) -> Weights | str:
    """The checkpoint and flag that serve `model` at `precision`, or a sentence saying what
    is missing."""
    native = NATIVE.get(model.name, "bf16")
    if precision == native:
        return Weights(model_id(model), None)
    if precision in ON_THE_FLY and native == "bf16":
        return Weights(model_id(model), ON_THE_FLY[precision])
    checkpoint = QUANTIZED.get((model.name, precision))
    if checkpoint is not None and not checkpoint.checked:
        return (f"{precision} weights of {model.name} need {checkpoint.hf_id}, whose name is "
                f"unverified (planner/checkpoints.py); check it on the hub and say how")
    if checkpoint is not None:
        return Weights(checkpoint.hf_id, None)  # vLLM reads the method from its config.json
    article = "an" if precision[0] in "aeiou" else "a"
    return (f"{precision} weights of {model.name} need {article} {precision} checkpoint; "
            f"none is known (planner/checkpoints.py lists them)")


def speculation_for(model: Model, spec: SpecDecode) -> SpecDecode | str:
    """`spec` with the draft it needs resolved (or the model's own MTP layers), or a sentence
    saying what is missing."""
    if spec.method in NEEDS_NO_DRAFT or spec.method in MTP.values():
        return spec
    if spec.draft:
        return spec
    if spec.method in ("eagle", "eagle3", "mtp"):
        if model.name in MTP:
            return replace(spec, method=MTP[model.name])
        draft = DRAFTS.get(model.name)
        if draft is not None and not draft.checked:
            return (f"{spec.method} speculative decoding of {model.name} needs {draft.hf_id}, "
                    f"whose name is unverified (planner/checkpoints.py)")
        if draft is not None:
            return replace(spec, method=draft.method, draft=draft.hf_id)
    return (f"{spec.method} speculative decoding of {model.name} needs a draft model; none is "
            f"known (planner/checkpoints.py lists them; n-gram needs none)")


def cp_servable(model: Model) -> str:
    """Why no exported engine runs prefill context parallelism for `model`, or "". vLLM 0.32
    runs it on MLA attention only (its other backends leave supports_pcp off); SGLang 0.5.23
    runs it for the models whose attention it splits by the attention-TP width (DeepSeek's
    MLA, Qwen3), not for Llama, Mistral or Qwen2, whose heads it splits by the whole TP world."""
    if model.is_mla:
        return ""
    return (f"prefill context parallelism for {model.name} runs in neither vLLM 0.32 (MLA "
            f"attention only) nor SGLang 0.5.23 (DeepSeek and Qwen3 models only)")


def servable(d: Deployment) -> Deployment | str:
    """The deployment as vLLM (or, for context parallelism, SGLang) can run it (its draft
    resolved), or why it cannot run."""
    weights = weights_for(d.model, d.weights)
    if isinstance(weights, str):
        return weights
    why = cp_servable(d.model) if d.cp > 1 else ""
    if why:
        return why
    if d.spec is None:
        return d
    if d.pp > 1:
        return "speculative decoding with pipeline parallelism is not supported by vLLM V1"
    spec = speculation_for(d.model, d.spec)
    if isinstance(spec, str):
        return spec
    return d if spec == d.spec else _with_spec(d, spec)


def _with_spec(d: Deployment, spec: SpecDecode) -> Deployment:
    return replace(d, spec=spec)
