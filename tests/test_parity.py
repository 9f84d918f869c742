"""Parity with Hugging Face transformers, an implementation nobody here wrote."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = (
    "The history of computing is long and full of surprises. Early mechanical calculators gave "
    "way to electronic machines, and engineers learned to build faster processors every year. "
    "Today, large language models run on"
)


@pytest.fixture(scope="module")
def hf_demo(demo_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(demo_gguf.parent), gguf_file=demo_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def demo_llm(demo_gguf):
    # float32 on both sides: "auto" is bfloat16 on CPUs with bfloat16 instructions.
    return LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)


def _prompt_ids(llm: LLM, n: int) -> list[int]:
    ids = llm.tokenizer.encode(PROMPT * 3)[:n]
    assert len(ids) == n
    return ids


def test_demo_logits_match_transformers(demo_llm, hf_demo):
    ids = _prompt_ids(demo_llm, 64)
    ours = demo_llm.prompt_logits(ids)
    with torch.no_grad():
        theirs = hf_demo(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (64, 49152)
    assert (ours - theirs).abs().max().item() < 1e-3


def test_demo_greedy_tokens_match_transformers(demo_llm, hf_demo):
    ids = _prompt_ids(demo_llm, 64)
    ours = demo_llm.generate([ids], SamplingParams(temperature=0, max_tokens=32,
                                                   ignore_eos=True))[0].token_ids
    with torch.no_grad():
        theirs = hf_demo.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                  min_new_tokens=32)[0, 64:].tolist()
    assert ours == theirs


def test_demo_greedy_tokens_match_transformers_in_a_ragged_batch(demo_llm, hf_demo):
    """Four prompts of different lengths decoded together: each step's attention reads each
    sequence's own keys from the paged cache (the C kernel on the CPU, where it builds), and
    every reply is what transformers generates for its prompt alone."""
    prompts = [_prompt_ids(demo_llm, n) for n in (64, 23, 41, 7)]
    ours = demo_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True))
    for ids, reply in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = hf_demo.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                      min_new_tokens=24)[0, len(ids):].tolist()
        assert reply.token_ids == theirs


def _tiny(kind: str, tmp_path, demo_checkpoint, **extra):
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}
    config = cfg_cls(vocab_size=49152, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, tie_word_embeddings=False,
                     eos_token_id=2, bos_token_id=1, **extra)
    torch.manual_seed(0)
    model = model_cls[kind](config).eval()
    folder = tmp_path / f"tiny-{kind}"
    model.save_pretrained(folder, safe_serialization=True)
    demo_checkpoint.tokenizer.save(folder)
    return model, folder


@pytest.mark.parametrize("kind,extra", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 500000.0}),
    ("qwen2", {}),
])
def test_tiny_random_models_match_transformers(kind, extra, tmp_path, demo_checkpoint):
    model, folder = _tiny(kind, tmp_path, demo_checkpoint, **extra)
    llm = LLM(str(folder), device="cpu", dtype="float32", kv_cache_tokens=512)
    ids = list(range(100, 300, 3))[:60]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                min_new_tokens=16)[0, len(ids):].tolist()
    assert (llm.prompt_logits(ids) - theirs).abs().max().item() < 1e-3
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert ours[0].token_ids == greedy
    if kind == "qwen2":
        assert llm.config.attention_bias and llm.model.layers[0].qkv_bias is not None
