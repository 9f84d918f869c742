"""Speculative decoding: the rejection rule's statistics, and lossless greedy output on the demo."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.spec import parse_spec
from engine.spec.ngram import NgramIndex, propose_ngram, propose_ngram_paths
from engine.spec.verify import residual, verify_greedy, verify_sampled

P = torch.tensor([0.5, 0.3, 0.15, 0.05])
NEXT = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the target after the draft token


def _first_token_frequencies(rule, draft_dist: torch.Tensor | None, trials: int = 20000):
    """How often each token comes out first when drafts come from draft_dist (or token 1)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.stack([P, NEXT])
    counts = torch.zeros(4)
    for _ in range(trials):
        if draft_dist is None:
            draft, q = [1], None
        else:
            draft = [int(torch.multinomial(draft_dist, 1, generator=gen))]
            q = draft_dist.unsqueeze(0)
        counts[rule(probs, draft, q, gen)[0]] += 1
    return counts / trials


def _chi_square(freq: torch.Tensor, expected: torch.Tensor, trials: int = 20000) -> float:
    return float(((freq - expected) ** 2 / expected).sum() * trials)


@pytest.mark.parametrize("draft_dist", [None, torch.tensor([0.1, 0.1, 0.4, 0.4]),
                                        torch.tensor([0.5, 0.3, 0.15, 0.05])])
def test_rejection_rule_keeps_the_target_distribution(draft_dist):
    freq = _first_token_frequencies(verify_sampled, draft_dist)
    # 3 degrees of freedom: chi-square above 16.3 has probability 0.001.
    assert _chi_square(freq, P) < 16.3


def test_a_wrong_acceptance_rule_is_caught():
    def accept_always(probs, draft, q, gen):
        return [draft[0], 0]

    def forget_to_remove_the_draft(probs, draft, q, gen):
        u = float(torch.rand(1, generator=gen))
        if u <= float(probs[0, draft[0]]):
            return [draft[0]]
        return [int(torch.multinomial(probs[0], 1, generator=gen))]

    dist = torch.tensor([0.1, 0.1, 0.4, 0.4])
    assert _chi_square(_first_token_frequencies(accept_always, dist), P) > 1000
    assert _chi_square(_first_token_frequencies(forget_to_remove_the_draft, None), P) > 100


def test_hand_computed_cases():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    assert verify_greedy(logits, [1, 0]) == [1, 0, 2]  # both accepted, bonus argmax
    assert verify_greedy(logits, [1, 2]) == [1, 0]  # second rejected, replaced by the argmax
    assert verify_greedy(logits, [2, 0]) == [1]
    # A deterministic draft's residual drops the drafted token; a draft distribution is
    # subtracted and clipped at zero.
    assert torch.allclose(residual(P, 0, None), torch.tensor([0.0, 0.3, 0.15, 0.05]))
    r = residual(P, 2, torch.tensor([0.1, 0.1, 0.4, 0.4]))
    assert torch.allclose(r, torch.tensor([0.4, 0.2, 0.0, 0.0]))
    # A draft the target gives zero probability is always rejected.
    gen = torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    assert verify_sampled(probs, [0], None, gen) == [1]


def test_prompt_lookup_proposes_the_latest_continuation():
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    assert propose_ngram(tokens, 3, 4, 2) == [9, 2, 5]
    assert propose_ngram([1, 2, 3], 3, 4, 2) == []
    assert parse_spec("ngram:k=3,adaptive=0").num_draft_tokens == 3
    with pytest.raises(ValueError, match="Unknown speculative method"):
        parse_spec("medusa")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=1, max_size=30),
       st.integers(1, 8), st.integers(1, 4), st.sampled_from([(4, 2), (3, 1), (2, 2)]))
def test_the_ngram_index_answers_as_the_scan(chunks, k, branches, sizes):
    """Prompt lookup's index gives the scans' drafts as a sequence grows a few tokens at a time
    (a small vocabulary, so n-grams repeat), and starts over when given fewer tokens (which
    then grow otherwise)."""
    n_max, n_min = sizes
    index, tokens = NgramIndex(n_max, n_min), []
    for chunk in chunks:
        tokens = tokens + chunk
        assert index.propose(tokens, k) == propose_ngram(tokens, k, n_max, n_min)
        assert index.paths(tokens, k, branches) == \
            propose_ngram_paths(tokens, k, n_max, n_min, branches)
    fewer = tokens[: len(tokens) // 2]
    regrown = fewer + [(t + 1) % 4 for t in tokens[len(fewer) :]]  # other tokens after them
    for other in (fewer, regrown):
        assert index.paths(other, k, branches) == propose_ngram_paths(other, k, n_max, n_min,
                                                                      branches)


COPY_PROMPT = ("Copy this text exactly.\n\nThe quick brown fox jumps over the lazy dog while the "
               "cat watches from the window and the bird sings on the fence.\n\nCopy:\n")
PROMPTS = [COPY_PROMPT, "The capital of France is", "def fibonacci(n):\n    if n < 2:",
           "List the colors of the rainbow: red, orange,"]


@pytest.fixture(scope="module")
def engines(demo_gguf):
    plain = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=2048)
    spec = LLM(str(demo_gguf), device="cpu", dtype="float32",
               kv_cache_tokens=2048, speculative="ngram")
    return plain, spec


def test_greedy_output_is_identical_alone_and_batched(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    alone = [spec.generate([p], params)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in spec.generate(PROMPTS, params)]
    assert alone == expected and together == expected
    c = spec.spec.counters
    assert c.draft_tokens > 0 and 0 < c.accepted_tokens <= c.draft_tokens
    assert c.mean_accepted_length > 1.5  # the copy prompt is accepted in long runs
    assert spec.block_manager.num_used_blocks == 0


def test_speculation_survives_preemption(demo_gguf, engines, monkeypatch):
    from tests.test_spec_break_even import measured

    plain, _ = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    # Six blocks for four sequences of up to 75 tokens: several preemptions whatever is
    # drafted; step costs pinned so that what is drafted does not depend on the runner's load.
    small = measured(LLM(str(demo_gguf), device="cpu", dtype="float32",
                         kv_cache_tokens=96, speculative="ngram"), monkeypatch)
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == expected
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_sampled_speculation_is_reproducible_and_reports_stats(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=7, ignore_eos=True)
    a = spec.generate([COPY_PROMPT], params)[0]
    b = spec.generate([COPY_PROMPT], params)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32
    rid = spec.add_request(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=24))
    drafted = accepted = generated = 0
    while spec.has_unfinished():
        outputs, stats = spec.step()
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        generated += stats.num_generated_tokens
    assert drafted > 0 and accepted <= drafted
    assert generated == len(outputs[0].token_ids) and outputs[0].request_id == rid


def test_parse_draft_paths_with_commas_and_options():
    cfg = parse_spec("draft:/models/a,b/draft.gguf,k=3")
    assert cfg.method == "draft" and cfg.draft_model == "/models/a,b/draft.gguf"
    assert cfg.num_draft_tokens == 3
    with pytest.raises(ValueError, match="needs a model"):
        parse_spec("draft:")


def _tiny_draft(folder, tokenizer, vocab: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save(folder)
    return folder


def test_draft_model_speculation_is_lossless(demo_gguf, engines, tmp_path):
    plain, _ = engines
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    # The demo model drafting for itself accepts (nearly) everything; a random tiny draft
    # sharing its tokenizer accepts almost nothing. Both must leave the output unchanged.
    same = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=2048,
               speculative=f"draft:{demo_gguf},k=4,adaptive=0")
    assert [o.token_ids for o in same.generate(PROMPTS, params)] == expected
    assert [same.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    assert same.spec.counters.acceptance_rate > 0.95
    assert same.spec.counters.mean_accepted_length > 4
    tiny = _tiny_draft(tmp_path / "tiny", plain.tokenizer, plain.config.vocab_size)
    weak = LLM(str(demo_gguf), device="cpu", dtype="float32",
               kv_cache_tokens=2048, speculative=f"draft:{tiny}")
    assert [o.token_ids for o in weak.generate(PROMPTS, params)] == expected
    assert weak.spec.counters.acceptance_rate < 0.5
    sampled = SamplingParams(temperature=0.9, max_tokens=16, seed=11, ignore_eos=True)
    assert (same.generate([PROMPTS[2]], sampled)[0].token_ids
            == same.generate([PROMPTS[2]], sampled)[0].token_ids)
    assert same.block_manager.num_used_blocks == 0


def test_a_draft_with_another_tokenizer_is_refused(demo_gguf, tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    from engine.config import ModelError
    from engine.tokenizer import Tokenizer

    vocab = {f"w{i}": i for i in range(256)}
    other = Tokenizer(Backend(WordLevel(vocab, unk_token="w0")), eos_token_ids=[1])
    folder = _tiny_draft(tmp_path / "other", other, 256)
    with pytest.raises(ModelError, match="different tokenizer"):
        LLM(str(demo_gguf), device="cpu", dtype="float32",
            kv_cache_tokens=512, speculative=f"draft:{folder}")
