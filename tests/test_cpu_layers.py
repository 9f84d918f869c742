"""A decode step's layers in one C call (kernels/cpu_layers.py, cpu_kernels.c's decode_layers)
against the model's own op-by-op loop, on the demo model's real weights: the same tokens and
the same log-probabilities to the bit, and the loop wherever the call does not apply."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.features import StepFeature
from kernels import cpu_kernels, cpu_layers, cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.preferred(),
                                reason="bfloat16 weights keep oneDNN's layout on this CPU")

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers:", "Once upon a time, in a small village,",
           "def fibonacci(n):"]
# Sixteen: on a CPU with AMX, int4 weights go to int4_amx_linear from 8 rows.
MANY = [f"{p} ({i})" for i in range(4) for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return _llm(demo_gguf, "float")


@functools.cache
def _llm(demo_gguf, weights: str) -> LLM:
    return LLM(str(demo_gguf), device="cpu", dtype="bfloat16", weights=weights,
               kv_cache_tokens=2048)


class _Calls:
    """Counts the steps DecodeStack.run took (a result) and left to the loop (None)."""

    def __init__(self, monkeypatch) -> None:
        self.fused = self.declined = 0
        real = cpu_layers.DecodeStack.run

        def run(stack, *args):
            out = real(stack, *args)
            if out is None:
                self.declined += 1
            else:
                self.fused += 1
            return out

        monkeypatch.setattr(cpu_layers.DecodeStack, "run", run)


def _generate(llm, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2,
                                                ignore_eos=True, **params))
    return [(o.token_ids, [(t.logprob, t.top) for t in o.logprobs]) for o in outs]


def _without_stack(llm, run):
    stack, llm.model.decode_stack = llm.model.decode_stack, None
    try:
        return run()
    finally:
        llm.model.decode_stack = stack


@pytest.mark.parametrize(("weights", "prompts"), [
    ("float", PROMPTS[:1]), ("float", PROMPTS), ("int4", PROMPTS[:1]), ("int4", MANY),
    ("int8", PROMPTS)])
def test_decode_steps_run_in_one_call_and_match_the_loop_to_the_bit(demo_gguf, monkeypatch,
                                                                      weights, prompts):
    # Prompts of different lengths: ragged contexts in one batch, each row its own keys.
    llm = _llm(demo_gguf, weights)
    assert llm.model.decode_stack is not None
    calls = _Calls(monkeypatch)
    fused = _generate(llm, prompts)
    assert calls.fused >= 24 and calls.declined == 0  # every step, the prefill's too
    assert _without_stack(llm, lambda: _generate(llm, prompts)) == fused
    assert calls.fused >= 23  # the loop's run did not call it


def _staggered(llm, long_prompt: str) -> list:
    """One request decoding, then a long one arriving: with 32 tokens a step, its prefill runs
    in chunks beside the first one's decode rows. Both replies' tokens and log-probabilities."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    llm.add_request(PROMPTS[0], params)
    for _ in range(3):
        llm.step()
    llm.add_request(long_prompt, params)
    done = {}
    while llm.has_unfinished():
        outputs, _ = llm.step()
        done.update({o.request_id: o for o in outputs if o.finished})
    return [(o.token_ids, [(t.logprob, t.top) for t in o.logprobs])
            for _, o in sorted(done.items())]


def test_steps_mixing_prefill_chunks_and_decode_rows_take_one_call_to_the_bit(demo_gguf,
                                                                            monkeypatch):
    if not cpu_kernels.prefill_available():
        pytest.skip("prefill chunks take the loop without the prefill attention kernel")
    llm = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=2048,
              max_num_batched_tokens=32)
    shapes = []
    real = cpu_layers.DecodeStack.run

    def run(stack, h, cos, sin, meta, kv_caches, streams=None):
        out = real(stack, h, cos, sin, meta, kv_caches, streams)
        if out is not None:
            decode_rows = 0 if meta.decode_token_index is None else len(meta.decode_token_index)
            shapes.append((len(meta.prefills), decode_rows))
        return out

    monkeypatch.setattr(cpu_layers.DecodeStack, "run", run)
    long_prompt = " ".join(PROMPTS) * 3
    fused = _staggered(llm, long_prompt)
    assert any(chunks and rows for chunks, rows in shapes)  # mixed steps ran in one call
    assert _without_stack(llm, lambda: _staggered(llm, long_prompt)) == fused


def test_float32_activations_take_the_loop(demo_gguf):
    assert _llm(demo_gguf, "float").model.decode_stack.amx == cpu_linear.amx_runs()
    other = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=256)
    assert other.model.decode_stack is None


def test_a_quantized_cache_or_eviction_statistics_take_the_loop(demo_gguf, monkeypatch):
    calls = _Calls(monkeypatch)
    for option in ({"kv_cache_dtype": "int8"}, {"kv_policy": "h2o", "kv_budget": 64}):
        other = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=512,
                    **option)
        [out] = other.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8,
                                                            ignore_eos=True))
        assert len(out.token_ids) == 8, option
    assert calls.fused == 0


def test_a_refusing_kernel_leaves_the_step_to_the_loop_unchanged(llm, monkeypatch):
    # decode_layers answers -1 for a failed allocation: the step is run again op by op, and the
    # cache slots it may have written are rewritten with the same values.
    want = _without_stack(llm, lambda: _generate(llm, PROMPTS[:2]))
    real = cpu_kernels._library()

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_layers(self, *args):
            real.decode_layers(*args)  # writes the cache, then "fails"
            return -1

    monkeypatch.setattr(cpu_kernels, "_library", lambda: Refusing())
    calls = _Calls(monkeypatch)
    assert _generate(llm, PROMPTS[:2]) == want
    assert calls.declined >= 23 and calls.fused == 0


def _streams_of(llm, prompts) -> list[tuple]:
    """Every step's final states and kept residual streams (the runner's stream_layers)."""
    kept = []

    class Keep(StepFeature):
        def after_forward(self, step) -> None:
            kept.append((step.result.hidden.clone(), step.result.streams.clone()))

    llm.core.features.append(Keep())
    try:
        _generate(llm, prompts)
    finally:
        llm.core.features.pop()
    return kept


def test_middle_layer_streams_are_kept_by_the_one_call_as_by_the_loop(demo_gguf, monkeypatch):
    """A draft with fused features reads the residual stream after some of the target's
    layers (StepResult.streams): the one call writes them beside its own work, to the bit as
    the loop computes them, and the stream after the last layer is the final state before its
    norm."""
    llm = _llm(demo_gguf, "float")
    llm.runner.stream_layers = (3, 30)
    try:
        calls = _Calls(monkeypatch)
        fused = _streams_of(llm, PROMPTS[:2])
        assert calls.fused >= 24 and calls.declined == 0
        loop = _without_stack(llm, lambda: _streams_of(llm, PROMPTS[:2]))
    finally:
        llm.runner.stream_layers = ()
    hidden = llm.config.hidden_size
    assert len(fused) == len(loop) >= 24
    for (h, streams), (h_loop, streams_loop) in zip(fused, loop, strict=True):
        assert streams.shape == (h.shape[0], 2 * hidden) and streams.dtype == h.dtype
        assert torch.equal(streams, streams_loop) and torch.equal(h, h_loop)
        last = streams[:, hidden:].float()
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + llm.config.rms_norm_eps)
        torch.testing.assert_close(normed * llm.model.norm.float(), h.float(), rtol=0.02,
                                   atol=0.05)
        # The third layer's stream is another state, not a copy of the last one's.
        assert not torch.allclose(streams[:, :hidden], streams[:, hidden:], atol=1.0)
