"""The GGUF-built tokenizer against transformers' and SmolLM2's original pipelines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from engine.config import ModelError
from engine.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

TEXTS = [
    "Hello world, how are you?",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "Привет, мир! 你好，世界。 こんにちは 🙂🚀👍🏽 café naïve",
    "tabs\t\tand   spaces    and\n\n\nnewlines \r\n end  ",
    "digits 0 12 345 6789 3.14159 1,000,000 x1y22 2024-01-31",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they've said 'we'll' -- it's   <tag attr=\"v\">&amp;</tag>",
    "",
    " leading space and trailing space ",
]


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(demo_gguf):
    """transformers' own tokenizer built from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name)


@pytest.fixture(scope="session")
def original_smollm2(hf_gguf_tokenizer):
    """SmolLM2's original pre-tokenizer (its tokenizer.json) over the same vocabulary.

    transformers' GGUF converter has no entry for `tokenizer.ggml.pre = "smollm"` and falls back
    to plain GPT-2 ByteLevel, dropping the digit split that llama.cpp (`\\p{N}` first) and the
    original HF tokenizer.json (Digits(individual_digits=True) + ByteLevel) both apply. This is the
    reference our tokenizer must match on every text.
    """
    backend = hf_gguf_tokenizer.backend_tokenizer
    original = type(backend).from_str(backend.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return original


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_original_smollm2(demo_checkpoint, original_smollm2, text):
    ours = demo_checkpoint.tokenizer.encode(text)
    assert ours == original_smollm2.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_gguf(demo_checkpoint, hf_gguf_tokenizer, text):
    # SmolLM2's vocabulary has no multi-digit tokens, so skipping the digit split happens to
    # give the same ids here; this pins that transformers and we read the same vocab/merges.
    ours = demo_checkpoint.tokenizer.encode(text)
    assert ours == hf_gguf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(demo_checkpoint, hf_gguf_tokenizer, text):
    tok = demo_checkpoint.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    expected = hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == expected


def test_special_tokens_are_single_ids(demo_checkpoint):
    tok = demo_checkpoint.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 4093, 2]) == "user"
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    # eos from the metadata first, then <|endoftext|>, which llama.cpp also stops on.
    assert tok.eos_token_ids == (2, 0)
    assert demo_checkpoint.config.eos_token_ids == (2, 0)


def test_add_special_tokens_follows_gguf_flag(demo_checkpoint):
    # SmolLM2 sets tokenizer.ggml.add_bos_token = false.
    tok = demo_checkpoint.tokenizer
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_chat_template_matches_transformers(demo_checkpoint, hf_gguf_tokenizer):
    messages = [
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    for prompt in (True, False):
        ours = demo_checkpoint.tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
        ref = hf_gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        )
        assert ours == ref
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_default_chatml_template_and_helpers(demo_checkpoint):
    backend = demo_checkpoint.tokenizer.backend
    tok = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2])
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert text == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    dated = Tokenizer(backend, chat_template="{{ strftime_now('%Y') | length }}")
    assert dated.apply_chat_template([]) == "4"
    strict = Tokenizer(backend, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ModelError, match="no system role"):
        strict.apply_chat_template([])


def test_save_round_trip(demo_checkpoint, tmp_path):
    from engine.loader.hf import chat_template

    tok = demo_checkpoint.tokenizer
    path = tok.save(tmp_path)
    again = Tokenizer(type(tok.backend).from_file(str(path)))
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert chat_template(tmp_path, {}) is None
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert chat_template(tmp_path, config) == tok.chat_template


def test_tokenizer_module_does_not_import_torch():
    code = "import sys, engine.tokenizer, engine.models; print('torch' in sys.modules)"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert out.stdout.strip() == "False"


def write_sentencepiece_gguf(path: Path) -> Path:
    """A tiny GGUF with a Llama-style sentencepiece vocabulary (scores, byte fallback)."""
    import gguf
    import numpy as np

    words = ["▁", "t", "h", "e", "a", "n", "d", "o", "r", "l", "w", "▁t", "he", "▁the", "an"]
    words += ["▁an", "▁and", "or", "▁w", "▁wor", "ld", "▁world", "▁a", "▁h", "el", "lo"]
    words += ["▁hel", "▁hello", "ll", "▁he"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(words))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    from engine.loader.gguf import open_gguf, read_tokenizer

    path = write_sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = read_tokenizer(open_gguf(path), path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "the and the world", "Hello World!", "hello  world", "xyz ü 🙂"]:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == ref.encode(text)
        assert ours.decode(ids) == text
    assert ours.encode("hello world") == [286, 280]  # no <s> unless asked for
    # A leading space: llama.cpp prefixes one more space ("▁▁the" -> ▁, ▁the) and so do we,
    # which round-trips; transformers' Metaspace drops it.
    assert ours.encode(" the") == [259, 272]
    assert ours.decode(ours.encode(" the")) == " the"
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1


def test_long_texts_encode_the_same_without_holding_the_gil(demo_checkpoint, hf_gguf_tokenizer):
    """Past GIL_FREE_ENCODE_CHARS the tokenizer takes the encode_batch path (which releases the
    GIL); the ids must be those of the plain path and of transformers."""
    from engine.tokenizer import GIL_FREE_ENCODE_CHARS

    tok = demo_checkpoint.tokenizer
    text = "Ünïcode, digits 12345 and  spaces\n" * (GIL_FREE_ENCODE_CHARS // 30)
    assert len(text) > GIL_FREE_ENCODE_CHARS
    ids = tok.encode(text)
    assert ids == tok.backend.encode(text, add_special_tokens=False).ids
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
