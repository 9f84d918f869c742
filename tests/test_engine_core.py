"""The engine core's step protocol (features plugged in through hooks) and the verifier that
checks a whole step's drafts at once, on the demo model and against the rejection rule."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.features import Step, StepFeature
from engine.sampler import argmax_rows, filtered_probs
from engine.spec.verify import verify_sampled, verify_sampled_all

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "List the colors: red, orange,"]


class Recorder(StepFeature):
    """Records the hooks it is called through, and forces one request's tokens to `token`."""

    def __init__(self, forced_request: str | None = None, token: int = 0) -> None:
        self.calls: list[str] = []
        self.preempted: list[str] = []
        self.forced_request, self.token = forced_request, token

    def before_schedule(self, running) -> None:
        self.calls.append("before_schedule")

    def wants_mass(self, scheduled) -> bool:
        self.calls.append("wants_mass")
        return False

    def choose(self, step: Step, logits, rows, chosen) -> None:
        self.calls.append("choose")
        for i, s in enumerate(step.sampling):
            if s.seq.request_id == self.forced_request:
                chosen[i] = [self.token]

    def after_forward(self, step: Step) -> None:
        self.calls.append("after_forward")
        self.computed = [s.seq.num_computed_tokens for s in step.scheduled]

    def after_append(self, step: Step) -> int:
        self.calls.append("after_append")
        return 0

    def on_preempt(self, seq) -> None:
        self.preempted.append(seq.request_id)


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)


def test_a_plugged_in_feature_sees_every_step_in_order_and_chooses_tokens(llm):
    want = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    recorder = Recorder(forced_request="forced", token=want[0])
    llm.core.features.append(recorder)
    try:
        llm.add_request(PROMPTS[0], GREEDY, request_id="free")
        llm.add_request(PROMPTS[1], GREEDY, request_id="forced")
        outputs = {}
        while llm.has_unfinished():
            for out in llm.step()[0]:
                outputs[out.request_id] = out
    finally:
        llm.core.features.remove(recorder)
    hooks = ["before_schedule", "wants_mass", "choose", "after_forward", "after_append"]
    steps = len(recorder.calls) // len(hooks)
    assert recorder.calls == hooks * steps and steps >= GREEDY.max_tokens
    assert outputs["forced"].token_ids == [want[0]] * GREEDY.max_tokens
    assert outputs["free"].token_ids == want  # the other request is its own greedy reply
    assert recorder.preempted == []


def test_preemption_resets_each_feature_through_its_hook(demo_gguf):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(demo_gguf), device="cpu", dtype="float32",
                kv_cache_tokens=2048, speculative="ngram")
    expected = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    # 6 blocks of 16 for three requests of about 48 tokens each: preemption, more than once.
    small = LLM(str(demo_gguf), device="cpu", dtype="float32",
                kv_cache_tokens=96, speculative="ngram",
                prefix_caching=True)
    recorder = Recorder()
    small.core.features.append(recorder)
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == expected
    assert len(recorder.preempted) == small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


P = torch.tensor([0.5, 0.3, 0.15, 0.05])
NEXT = torch.tensor([0.1, 0.2, 0.3, 0.4])


def _batched_first_tokens(trials: int = 6000) -> torch.Tensor:
    """First-token frequencies of three sequences verified together in every trial: a one-token
    deterministic draft, a two-token sampled draft, and no draft at all."""
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    q = torch.tensor([0.1, 0.1, 0.4, 0.4])
    counts = torch.zeros(3, 4)
    probs = torch.stack([P, NEXT, P, NEXT, NEXT, P])
    for _ in range(trials):
        sampled = [int(torch.multinomial(q, 1, generator=gens[1])) for _ in range(2)]
        out = verify_sampled_all(probs, [[1], sampled, []], [None, q.expand(2, 4), None], gens)
        for i, tokens in enumerate(out):
            counts[i, tokens[0]] += 1
    return counts / trials


def test_batched_verification_keeps_each_sequence_on_the_target_distribution():
    freq = _batched_first_tokens()
    for row in freq:
        # 3 degrees of freedom: chi-square above 16.3 has probability 0.001.
        assert float(((row - P) ** 2 / P).sum() * 6000) < 16.3


def test_a_sequence_verified_in_a_batch_gets_the_tokens_it_gets_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 50, generator=gen) * 3
    params = [SamplingParams(temperature=0.9, top_k=20)] * 9
    probs = filtered_probs(logits, params)
    drafts = [[3, 4], [7], [1, 2, 5]]  # rows 0-2, 3-4 and 5-8

    def gens():
        return [torch.Generator().manual_seed(s) for s in (11, 12, 13)]

    together = verify_sampled_all(probs, drafts, [None] * 3, gens())
    alone = [verify_sampled(probs[a:b], d, None, g)
             for (a, b), d, g in zip([(0, 3), (3, 5), (5, 9)], drafts, gens(), strict=True)]
    assert together == alone
    assert all(1 <= len(t) <= len(d) + 1 for t, d in zip(together, drafts, strict=True))


@pytest.fixture(scope="module")
def prompt_logits(llm) -> torch.Tensor:
    """The demo model's logits at every position of PROMPTS (one prefill each, made once)."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    logits = torch.cat([llm.prompt_logits(i) for i in ids])
    assert logits.dtype == torch.float32 and logits.shape[0] == sum(map(len, ids))
    return logits


def test_argmax_rows_is_torchs_argmax_on_real_logits_ties_nans_and_views(prompt_logits):
    """The greedy choice goes through NumPy on the CPU (torch's CPU argmax is 20x slower): it
    must pick exactly torch.argmax's token, ties (the first), NaNs and infinities included."""
    logits = prompt_logits
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    odd = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 5.0, float("nan"), 1.0],
                        [1.0, float("nan"), 9.0, 1.0], [-float("inf")] * 4,
                        [float("inf"), 1.0, float("inf"), 0.0]])
    for x in (odd, odd[:, ::2], odd.t(), logits[::3, 7::5], logits.bfloat16(), odd.double()):
        assert argmax_rows(x) == x.argmax(dim=-1).tolist()


def _exact_nucleus(row: torch.Tensor, k: int, p: float) -> set[int]:
    """The top-k / top-p kept tokens of one row, from a whole-row sort in float64."""
    values, order = row.double().sort(descending=True)
    k = min(k, row.numel()) if k > 0 else row.numel()
    probs = torch.softmax(values[:k], dim=-1)
    keep = max(1, int(((probs.cumsum(-1) - probs) < p).sum()))
    return set(order[:keep].tolist())


def _assert_cut_as_a_sort_does(row: torch.Tensor, kept_row: torch.Tensor, k: int, p: float):
    """kept_row (row cut to its top-k and top-p) keeps _exact_nucleus's tokens, with their
    logits, but for tokens tied at the nucleus' edge."""
    kept = set(torch.isfinite(kept_row).nonzero().flatten().tolist())
    exact = _exact_nucleus(row, k, p)
    edge = row[list(exact)].min()
    assert len(kept) == len(exact)
    assert all(row[t] == edge for t in kept ^ exact)
    assert torch.equal(kept_row[list(kept)], row[list(kept)])


@pytest.mark.parametrize("top_k, top_p", [(0, 0.95), (0, 0.5), (0, 0.01), (40, 1.0), (40, 0.9),
                                          (1, 0.9), (100_000, 0.99), (0, 0.999)])
def test_the_nucleus_is_the_whole_sorts_on_real_logits(prompt_logits, top_k, top_p):
    """Top-k and top-p keep exactly the tokens a float64 sort of the whole row keeps, with
    their logits, at several temperatures of the demo model's real logits (nuclei of one token
    to tens of thousands). Logits computed in bfloat16 tie often (8 significant bits over 49,152
    tokens); which of the tokens tied at the nucleus' edge a sort puts first is arbitrary, so
    there the sets may differ by tokens of the edge's value, never in size."""
    from engine.sampler import _apply_top_k_top_p

    for temperature in (0.3, 1.0, 2.0):
        scaled = prompt_logits / temperature
        fast = _apply_top_k_top_p(scaled, [top_k] * len(scaled), [top_p] * len(scaled))
        for row, kept_row in zip(scaled, fast, strict=True):
            _assert_cut_as_a_sort_does(row, kept_row, top_k, top_p)


def test_a_batch_of_mixed_top_k_and_top_p_cuts_each_row_as_a_whole_sort_does(prompt_logits):
    """Rows of one step cut together with different settings each (nuclei inside the first
    ranks, past them, top-k inside and past them, rows left whole) keep what a float64 sort of
    each row alone keeps."""
    from engine.sampler import _apply_top_k_top_p

    settings = [(0, 0.95), (0, 1.0), (40, 0.9), (1000, 1.0), (0, 0.999), (5, 0.5), (300, 0.99),
                (0, 0.01), (100_000, 0.7)]
    rows = prompt_logits[: 4 * len(settings)] / 0.8
    top_k = [settings[i % len(settings)][0] for i in range(len(rows))]
    top_p = [settings[i % len(settings)][1] for i in range(len(rows))]
    cut = _apply_top_k_top_p(rows, top_k, top_p)
    for row, kept_row, k, p in zip(rows, cut, top_k, top_p, strict=True):
        _assert_cut_as_a_sort_does(row, kept_row, k, p)
