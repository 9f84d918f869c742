"""The demo model's shipped early-exit draft: it loads, it is lossless, bad drafts are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelError
from engine.spec import parse_spec
from engine.spec.config import DEMO_DRAFT_PATH
from engine.spec.exit_draft import FORMAT, vocab_fingerprint

PROMPTS = ["Write a short poem about the ocean.", "Explain what a GPU does in simple terms.",
           "The capital of France is"]


@pytest.fixture(scope="module")
def plain(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048)


def _chat(llm: LLM) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]


def test_the_shipped_draft_is_small_and_names_its_target(plain):
    assert DEMO_DRAFT_PATH.stat().st_size <= 20 * 1024 * 1024
    with safe_open(str(DEMO_DRAFT_PATH), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT and meta["tokenizer_sha256"] == vocab_fingerprint(
        plain.tokenizer)
    ids = load_file(str(DEMO_DRAFT_PATH))["draft.vocab_ids"]
    assert int(ids.min()) >= 0 and int(ids.max()) < plain.config.vocab_size
    provenance = json.loads((DEMO_DRAFT_PATH.parent / "README.json").read_text())
    assert provenance["file"] == DEMO_DRAFT_PATH.name


def test_greedy_output_is_identical_with_the_demo_draft(demo_gguf, plain):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _chat(plain)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048, speculative="demo-draft:k=4")
    assert spec.spec.config.draft_model == str(DEMO_DRAFT_PATH)
    alone = [spec.generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in spec.generate(prompts, params)]
    assert alone == expected and together == expected
    c = spec.spec.counters
    # A trained draft is right far more often than chance on the demo model's own chat.
    assert c.draft_tokens > 0 and c.acceptance_rate > 0.3
    assert spec.block_manager.num_used_blocks == 0
    # Sampled requests draw from the draft's distribution spread over the full vocabulary.
    sampled = SamplingParams(temperature=0.8, max_tokens=16, seed=5, ignore_eos=True)
    a, b = (spec.generate([prompts[0]], sampled)[0].token_ids for _ in range(2))
    assert a == b and len(a) == 16


def test_spec_names_for_the_demo_draft():
    cfg = parse_spec("demo-draft:k=3")
    assert cfg.method == "draft" and cfg.num_draft_tokens == 3
    assert cfg.draft_model == str(DEMO_DRAFT_PATH)
    with pytest.raises(ValueError, match="Unknown option 'n'"):
        parse_spec("demo-draft:n=3,x")


def _altered_draft(folder: Path, **meta_changes: str) -> Path:
    with safe_open(str(DEMO_DRAFT_PATH), framework="pt") as f:
        meta = dict(f.metadata())
    meta.update(meta_changes)
    path = folder / "altered.safetensors"
    save_file(load_file(str(DEMO_DRAFT_PATH)), str(path), metadata=meta)
    return path


def test_bad_drafts_are_refused_with_a_reason(demo_gguf, tmp_path):
    def load(path) -> None:
        LLM(str(demo_gguf), device="cpu", kv_cache_tokens=256, speculative=f"draft:{path}")

    with pytest.raises(ModelError, match="does not exist"):
        load(tmp_path / "missing.safetensors")
    with pytest.raises(ModelError, match="different tokenizer"):
        load(_altered_draft(tmp_path, tokenizer_sha256="0" * 64))
    with pytest.raises(ModelError, match="does not fit this model"):
        load(_altered_draft(tmp_path, hidden_size="960"))
    other = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(ModelError, match="not a servescope early-exit draft"):
        load(other)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        load(tmp_path / "junk.safetensors")
