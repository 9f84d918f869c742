"""Speculation stops below break-even: draft lengths from measured step costs and acceptance."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.spec.break_even import (
    DRAFT_MARGIN,
    PROBE_EVERY,
    MovingRatio,
    StepCosts,
    branch_threshold,
    draft_lengths,
    expected_accepted,
    expected_accepted_by_depth,
)

# Step costs measured on this project's 2-core CPU (ms by query tokens, float32 demo model at
# batch 1): a verify step of 1 + k tokens costs 1.5-1.9 plain steps.
CPU_MS = {1: 20.0, 2: 30.0, 3: 34.0, 4: 36.0, 6: 38.0}


def costs(ms: dict[int, float], draft_ms: float | None = None) -> StepCosts:
    c = StepCosts()
    for n, t in ms.items():
        c.observe_step(n, t / 1e3)
    if draft_ms is not None:
        c.observe_drafting(1, draft_ms / 1e3)
    return c


def test_expected_accepted_is_the_accepted_prefix():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.0, 5) == 0
    assert expected_accepted(0.9, 0) == 0
    assert expected_accepted_by_depth(0.5, 3) == pytest.approx([0.5, 0.75, 0.875])


def test_costs_are_learnt_and_extrapolated_along_a_line():
    c = StepCosts()
    assert c.step_s(1) is None and not c.known
    c.observe_step(1, 0.020)
    assert c.step_s(1) == 0.020 and c.step_s(3) is None  # one size says nothing of others
    c.observe_step(5, 0.060)
    assert c.step_s(3) == pytest.approx(0.040) and c.step_s(9) == pytest.approx(0.100)
    c.observe_step(1, 0.030)  # a moving average, not the last value
    assert 0.020 < c.step_s(1) < 0.030


def test_a_falling_line_is_not_believed():
    c = costs({1: 30.0, 4: 20.0})  # noise: a bigger step measured faster
    assert c.step_s(8) >= c.step_s(4) - 1e-12


def test_a_bigger_step_never_prices_below_a_smaller_one():
    # Measured in one run on the 2-core Xeon in bfloat16 (ms): T(1) from one rare plain step
    # (the sequence drafted nearly every step), above T(2) to T(5). Read as measured, one
    # draft's verification saved time, and drafts were made at 5% acceptance.
    c = costs({1: 16.0, 2: 12.1, 3: 12.9, 4: 13.0, 5: 13.3, 7: 14.2, 9: 17.0, 10: 19.2,
               11: 18.6}, draft_ms=0.4)
    times = [c.step_s(n) for n in range(1, 14)]
    assert times == sorted(times)
    assert c.step_s(1) == pytest.approx((16.0 + 12.1 + 12.9 + 13.0 + 13.3) / 5 / 1e3)
    assert draft_lengths([0.05], [3], c, [2.0]) == [0]
    assert draft_lengths([0.5], [3], c, [2.0])[0] > 0


def test_no_drafts_where_they_do_not_pay_on_this_cpu():
    c = costs(CPU_MS)
    # A plain step makes 1 token in 20 ms; 2 drafts cost 34 ms: they need E > 0.7 tokens.
    assert draft_lengths([0.2], [5], c) == [0]
    assert draft_lengths([0.3], [5], c) == [0]
    k = draft_lengths([0.9], [5], c)[0]
    assert k >= 3  # a copied passage: long drafts pay
    assert draft_lengths([0.9], [2], c) == [2]  # never more than the cap


def test_the_proposers_cost_counts_against_drafting():
    free = draft_lengths([0.6], [5], costs(CPU_MS))[0]
    dear = draft_lengths([0.6], [5], costs(CPU_MS, draft_ms=15.0))[0]
    assert free > 0 and dear < free


# 16 sequences: each extra query token costs 3 ms, where a decoding sequence's token costs 10.
BATCH16_MS = {16: 160.0, 17: 163.0, 18: 166.0, 20: 172.0, 24: 184.0}


def test_a_large_batch_drafts_only_for_the_sure_sequences():
    lengths = draft_lengths([0.95] + [0.4] * 15, [4] * 16, costs(BATCH16_MS))
    assert lengths[0] > 0 and lengths[1:] == [0] * 15


def test_a_sequence_without_room_to_draft_does_not_hold_back_the_others():
    # Sequences left without drafts end the pricing of those less likely than them, but only
    # of those that could draft no deeper: the first one here has no room left (cap 0).
    c = costs(CPU_MS)
    assert draft_lengths([0.9], [4], c)[0] > 0
    assert draft_lengths([0.95, 0.9], [0, 4], costs({1: 20.0, 2: 21.0, 3: 22.0, 4: 23.0,
                                                       5: 24.0, 6: 25.0}))[1] > 0


def test_a_draft_must_pay_by_a_margin():
    # One more query token at 16 sequences costs 9 ms where a sequence's token costs 10: a sure
    # draft pays 0.3% on paper, within what the noisy costs and the unpriced bookkeeping of
    # speculation take back, so none is made.
    assert DRAFT_MARGIN > 0
    tight = {16: 160.0, 17: 169.0, 18: 178.0, 20: 196.0, 24: 232.0}
    assert draft_lengths([0.95] * 16, [4] * 16, costs(tight)) == [0] * 16


def test_a_tree_is_priced_by_its_nodes_not_its_depth():
    # 16 sequences at the batch costs above, one of them drafting trees of 3 nodes per level:
    # a chain of depth k adds k query tokens, that tree 3k, for the same acceptance per level.
    rates, caps = [0.95] + [0.0] * 15, [4] * 16
    chain = draft_lengths(rates, caps, costs(BATCH16_MS))[0]
    tree = draft_lengths(rates, caps, costs(BATCH16_MS), [3.0] + [1.0] * 15)[0]
    assert chain > 0 and tree < chain
    # At batch 1 on this CPU extra query tokens are nearly free: the tree is worth drafting.
    assert draft_lengths([0.7], [4], costs(CPU_MS), [2.0])[0] > 0


def test_a_batch_size_never_stepped_is_measured_before_drafting():
    # Costs known at batch 1 to 6 only: 16 new requests do not draft on a guess at T(16 + k)
    # (batch 1's 0.5-10 ms a token made drafting at 16 look nearly free).
    assert draft_lengths([0.9] * 16, [4] * 16, costs(CPU_MS)) == [0] * 16
    assert draft_lengths([0.9], [4], costs(CPU_MS))[0] > 0  # a size it has stepped


def test_unmeasured_sizes_are_priced_from_the_nearest_measured_ones():
    # Measured on the 2-core EPYC in bfloat16 (ms): memory-bound small batches, then one
    # compute-bound batch of 16. A line fitted through all of them put T(17) below the
    # measured T(16), so one more query token looked like it saved time.
    c = costs({1: 12.7, 2: 13.8, 3: 13.0, 4: 13.7, 5: 13.7, 6: 14.4, 7: 14.5, 16: 24.7})
    assert c.step_s(17) > c.step_s(16) and c.step_s(20) > c.step_s(17)
    assert c.step_s(10) == pytest.approx(14.5e-3 + (24.7e-3 - 14.5e-3) * 3 / 9)
    assert draft_lengths([0.5] * 16, [3] * 16, c) == [0] * 16


def test_a_batch_is_priced_from_its_own_steps():
    # Measured on the 2-core EPYC in bfloat16 (ms): one sequence's verifications of 16-26
    # tokens took 28-31 ms, a plain step of 16 sequences 23. Priced from all steps alike, the
    # 16 sequences' drafts looked nearly free (T(26) about T(16)), and speculation ran 13%
    # slower than none at 16 concurrent requests.
    c = StepCosts()
    for n, ms in {1: 10.0, 4: 12.5, 8: 15.5, 12: 20.0, 16: 30.0, 20: 30.5, 26: 31.0}.items():
        c.observe_step(n, ms / 1e3, batch=1)
    c.observe_step(16, 23.0e-3, batch=16)
    rates, caps = [0.8] * 16, [3] * 16
    mixed = StepCosts(by_tokens=dict(c.by_tokens))  # the same steps, their batch forgotten
    assert sum(draft_lengths(rates, caps, mixed)) > 0
    at16 = c.at_batch(16)
    assert at16.step_s(16) == pytest.approx(23.0e-3)
    # T(16 + x) from the batch's own plain step along the slope of all steps.
    assert at16.step_s(20) == pytest.approx(23.0e-3 + 4 * c.slope())
    assert draft_lengths(rates, caps, at16) == [0] * 16
    assert draft_lengths([0.99] + rates[1:], [4] * 16, at16)[0] > 0  # a sure one still drafts
    # Batch 1 keeps its own steps; a batch never stepped drafts nothing until it has.
    assert c.at_batch(1).step_s(26) == pytest.approx(31.0e-3)
    assert draft_lengths([0.9] * 8, [3] * 8, c.at_batch(8)) == [0] * 8
    assert c.at_batch(8).known


def test_unknown_costs_leave_the_choice_to_the_old_rule():
    assert draft_lengths([0.9], [4], StepCosts()) is None
    assert draft_lengths([0.9], [4], costs({1: 20.0})) is None


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]


def measured(llm: LLM, monkeypatch) -> LLM:
    """The engine's step costs fixed at the CPU figures above (the machine's own, noisy on a
    shared runner, would make the test depend on the load); its decisions stay its own."""
    for n, ms in CPU_MS.items():
        llm.spec.costs.observe_step(n, ms / 1e3)
    monkeypatch.setattr(llm.spec.costs, "observe_step", lambda tokens, seconds, batch=None: None)
    return llm


def test_a_draft_that_is_always_wrong_stops_drafting_and_stays_lossless(demo_gguf, tmp_path,
                                                                         monkeypatch):
    from tests.test_spec import _tiny_draft

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    tiny = _tiny_draft(tmp_path / "tiny", plain.tokenizer, plain.config.vocab_size)
    drafts = {}
    for adaptive in (0, 1):
        llm = measured(LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024,
                           speculative=f"draft:{tiny},k=3,adaptive={adaptive}"), monkeypatch)
        assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == expected
        drafts[adaptive] = llm.spec.counters.drafts
        assert llm.spec.counters.acceptance_rate < 0.2
    # Fixed length: a draft every step. Break-even: a few while the acceptance estimate falls,
    # then a probe every PROBE_EVERY steps.
    assert drafts[0] >= 2 * 45
    assert drafts[1] <= 2 * (4 + 48 // PROBE_EVERY)


def test_a_draft_that_is_right_keeps_drafting(demo_gguf, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)
    expected = plain.generate([PROMPTS[1]], params)[0].token_ids
    same = measured(LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024,
                        speculative=f"draft:{demo_gguf},k=3"), monkeypatch)
    same.spec.costs.draft_token_s = 0.0  # as if drafting were free: acceptance decides
    monkeypatch.setattr(same.spec.costs, "observe_drafting", lambda tokens, seconds: None)
    assert same.generate([PROMPTS[1]], params)[0].token_ids == expected
    c = same.spec.counters
    assert c.acceptance_rate > 0.95 and c.mean_accepted_length > 3


def rejected_sequence(demo_gguf, monkeypatch):
    """An engine at the CPU costs above and a decoding sequence whose own drafts were all
    rejected."""
    spec = measured(LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024,
                        speculative="ngram"), monkeypatch)
    rid = spec.add_request("Hello", SamplingParams(temperature=0, max_tokens=4))
    spec.step()
    seq = spec.core.seqs[rid]
    seq.spec.position_rate, seq.spec.verifications = 0.0, 1
    return spec, seq


def test_a_sequence_left_without_drafts_probes_now_and_then(demo_gguf, monkeypatch):
    spec, seq = rejected_sequence(demo_gguf, monkeypatch)
    spec.spec.acceptance.num = 0.0  # and every other request's too: the prior is 0
    lengths = [spec.spec.draft_lengths([seq])[0] for _ in range(2 * PROBE_EVERY)]
    assert lengths.count(1) == 2 and set(lengths) == {0, 1}


def test_a_sequence_whose_drafts_were_rejected_drafts_again_where_others_are_accepted(
        demo_gguf, monkeypatch):
    """A few rejections stop a sequence's drafts; while it decodes without them its estimate
    drifts back to what drafts achieve for every request, so it drafts again within steps,
    not after a probe (PROBE_EVERY), and a verification then rules its estimate again."""
    spec, seq = rejected_sequence(demo_gguf, monkeypatch)
    assert spec.spec.position_prior == pytest.approx(0.8)  # others' drafts: mostly accepted
    lengths = [spec.spec.draft_lengths([seq])[0] for _ in range(8)]
    first = next(i for i, k in enumerate(lengths) if k)
    assert lengths[0] == 0 and 0 < first < 8
    assert seq.spec.position_rate < spec.spec.position_prior


def test_a_new_request_starts_from_what_earlier_drafts_achieved(demo_gguf, tmp_path,
                                                                monkeypatch):
    """A fresh engine lets a new request draft on an optimistic guess; once its drafts have
    been verified, a new request starts from the acceptance they had (here: a draft that is
    always wrong, so the next request does not draft at all before a probe)."""
    from tests.test_spec import _tiny_draft

    plain = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)
    tiny = _tiny_draft(tmp_path / "tiny", plain.tokenizer, plain.config.vocab_size)
    llm = measured(LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024,
                       speculative=f"draft:{tiny},k=3"), monkeypatch)

    def first_draft_length() -> int:
        rid = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
        llm.step()  # its prefill
        seq = llm.core.seqs[rid]
        length = llm.spec.draft_lengths([seq])[0]
        llm.abort(rid)
        while llm.has_unfinished():
            llm.step()
        return length

    assert first_draft_length() > 0
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert llm.spec.position_prior < 0.3
    assert first_draft_length() == 0


def test_the_old_rule_runs_only_where_break_even_does_not_decide():
    from engine.sequence import Sequence
    from engine.spec import SpecConfig
    from engine.spec.decoder import SpecDecoder, spec_state

    decoder = SpecDecoder(SpecConfig())
    decoder.costs = costs(CPU_MS)
    plain = Sequence("plain", [1, 2, 3], SamplingParams(temperature=0), 0.0)
    seeded = Sequence("seeded", [1, 2, 3], SamplingParams(temperature=0.8, seed=1), 0.0)
    for seq in (plain, seeded):
        spec_state(seq).cooldown = 5
    decoder.draft_lengths([plain, seeded])
    # Break-even decided the plain request's length: its cooldown is left alone. The seeded one
    # follows the acceptance rule, whose cooldown counts down.
    assert spec_state(plain).cooldown == 5 and spec_state(seeded).cooldown == 4
    decoder.costs = StepCosts()  # costs unknown: the acceptance rule decides for both
    decoder.draft_lengths([plain, seeded])
    assert spec_state(plain).cooldown == 4 and spec_state(seeded).cooldown == 3


def test_an_idle_sequence_probes_only_where_a_probe_costs_no_more_than_a_plain_token():
    from engine.sequence import Sequence
    from engine.spec import SpecConfig
    from engine.spec.break_even import PROBE_EVERY
    from engine.spec.decoder import SpecDecoder, spec_state

    def probes(batch_ms: dict, batch: int) -> int:
        """Drafts given to `batch` sequences break-even leaves idle (acceptance 0), over
        PROBE_EVERY steps."""
        decoder = SpecDecoder(SpecConfig(num_draft_tokens=3))
        decoder.costs = costs(batch_ms, draft_ms=0.3)
        seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams(temperature=0), 0.0)
                for i in range(batch)]
        decoder.acceptance.num = 0.0  # drafts never accepted so far: a prior of 0
        for seq in seqs:
            spec_state(seq).verifications, spec_state(seq).position_rate = 1, 0.0
        return sum(sum(decoder.draft_lengths(seqs)) for _ in range(PROBE_EVERY))

    # Batch 1 on this CPU: one more query token is nearly free, so each idle sequence probes
    # once every PROBE_EVERY steps.
    assert probes(CPU_MS, 1) == 1
    # 16 sequences on the EPYC before its kernel's fix: the 17th query token cost 3.6 ms of a
    # 22.4 ms step, more than twice a plain token's 1.4 ms: no probes.
    assert probes({1: 10.0, 8: 12.0, 16: 22.4, 17: 26.0, 24: 28.0}, 16) == 0
    # The same batch where the 17th token costs 0.5 ms: probes again.
    assert probes({1: 10.0, 8: 12.0, 16: 22.4, 17: 22.9, 24: 27.0}, 16) == 16


def test_costs_measured_in_a_slow_moment_are_measured_again():
    """Another process took the cores while verifications were measured (3x a plain step):
    drafting stops, and a size's cost is learnt only from steps of that size. Once the plain
    steps have gone on for STALE_STEPS, one sequence drafts its full depth (a cost probe); its
    verification's cost replaces the stale one, and drafting resumes. Before, the engine ran
    plain for the rest of its life in 1 of 4 trials of benchmarks/spec_recovery.py."""
    from engine.sequence import Sequence
    from engine.spec import SpecConfig
    from engine.spec.break_even import STALE_STEPS
    from engine.spec.decoder import SpecDecoder, spec_state

    decoder = SpecDecoder(SpecConfig(num_draft_tokens=3))
    decoder.costs = costs({1: 10.0, 2: 30.0, 3: 33.0, 4: 36.0}, draft_ms=0.3)
    seq = Sequence("s", [1, 2, 3], SamplingParams(temperature=0), 0.0)
    spec_state(seq).verifications, spec_state(seq).position_rate = 1, 0.6
    assert decoder.draft_lengths([seq]) == [0]
    plain_steps = 0
    while True:  # plain steps at the plain cost, while the other sizes age
        decoder.costs.observe_step(1, 0.010)
        plain_steps += 1
        if not decoder.costs.fresh_above(1):
            break
        assert decoder.draft_lengths([seq])[0] <= 1  # an idle probe at most
    assert plain_steps == STALE_STEPS  # the last verification size was measured 4th of 4
    assert decoder.draft_lengths([seq]) == [3]  # the cost probe
    assert decoder.draft_lengths([seq]) == [3]  # until a step bigger than a plain one is seen
    decoder.costs.observe_step(4, 0.011)  # its verification, at today's cost
    assert decoder.costs.step_s(4) == pytest.approx(0.011)  # replaced, not averaged in
    assert all(decoder.draft_lengths([seq])[0] > 0 for _ in range(5))


# A GPU-like step: extra query tokens nearly free at small batches.
FLAT_MS = {1: 10.0, 8: 10.2, 16: 10.5, 64: 14.0}


def test_a_branch_must_buy_more_than_its_query_token_costs():
    cpu, gpu = branch_threshold(costs(CPU_MS), 1), branch_threshold(costs(FLAT_MS), 1)
    # On this CPU a node must be accepted about one time in ten or more to pay; on a GPU at
    # batch 1 almost any node pays; a large batch asks more of each node.
    assert 0.05 < cpu < 0.5 and gpu < 0.01
    assert branch_threshold(costs(FLAT_MS), 32) > 5 * gpu
    # A drafted node's proposing is spent whether it is verified or not: only its query counts.
    assert branch_threshold(costs(CPU_MS, draft_ms=5.0), 1) == cpu
    assert branch_threshold(StepCosts(), 1) is None


def test_the_drafts_confidence_is_calibrated_by_what_is_accepted():
    cal = MovingRatio(0.95)
    assert cal.value(1.0, 2.0) == 1.0
    cal.observe(1, 1.0)
    assert cal.value(1.0, 2.0) == 1.0  # too little seen yet
    for i in range(40):  # nodes the draft gives 0.5 each, accepted one time in four
        cal.observe(i % 2, 1.0)
    assert cal.value(1.0, 2.0) == pytest.approx(0.5, abs=0.1)


@pytest.mark.parametrize("spec", ["demo-draft:lookup=0,branches=4",
                                  "demo-medusa:lookup=0,branches=4"])
def test_trees_keep_only_the_branches_that_pay(demo_gguf, monkeypatch, spec):
    """With this CPU's step costs, a tree's unlikely branches are dropped; where a query token
    is nearly free (a GPU's costs), the same proposer keeps them; the output is the plain
    engine's either way."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    width = {}  # tree nodes per level drafted
    for name, ms in (("cpu", CPU_MS), ("gpu", FLAT_MS)):
        llm = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024,
                  speculative=spec)
        for n, t in ms.items():
            llm.spec.costs.observe_step(n, t / 1e3)
        llm.spec.costs.draft_token_s = 0.0
        monkeypatch.setattr(llm.spec.costs, "observe_step",
                            lambda tokens, seconds, batch=None: None)
        monkeypatch.setattr(llm.spec.costs, "observe_drafting", lambda tokens, seconds: None)
        assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == expected
        c = llm.spec.counters
        width[name] = c.draft_nodes / c.draft_tokens
    assert width["cpu"] < 0.8 * width["gpu"], width


def test_prompt_lookup_and_the_model_behind_it_are_priced_apart(demo_gguf, tmp_path,
                                                                 monkeypatch):
    """Behind prompt lookup, a draft model that is always wrong does not cut lookup's drafts
    short: each source's drafts are priced from their own acceptance (and a new request's from
    that source's prior), so a reply that starts copying its prompt drafts deep at once."""
    from engine.spec.decoder import LookupFirst, spec_state
    from tests.test_spec import COPY_PROMPT, _tiny_draft

    plain = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024)
    tiny = _tiny_draft(tmp_path / "tiny", plain.tokenizer, plain.config.vocab_size)
    llm = measured(LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=1024,
                       speculative=f"draft:{tiny},k=3,lookup=1"), monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt in (COPY_PROMPT, PROMPTS[0]):  # lookup's copies, then the tiny draft's guesses
        assert llm.generate([prompt], params)[0].token_ids == \
            plain.generate([prompt], params)[0].token_ids
    lookup_prior = llm.spec.prior_of(LookupFirst.LOOKUP)
    model_prior = llm.spec.prior_of(LookupFirst.MODEL)
    assert model_prior < 0.5 < lookup_prior  # both started at 0.8

    rid = llm.add_request(COPY_PROMPT, params)
    seq = llm.core.seqs[rid]
    for _ in range(48):  # until the reply's tail occurs in the prompt
        llm.step()
        if llm.spec.proposer.source(seq) == LookupFirst.LOOKUP:
            break
    k = llm.spec.draft_lengths([seq])[0]
    assert spec_state(seq).source == LookupFirst.LOOKUP
    # Priced from the model's acceptance (or one estimate for both), it would not be drafted.
    as_model = draft_lengths([model_prior], [llm.spec.max_draft_tokens],
                             llm.spec.costs.at_batch(1), [1.0])[0]
    assert k >= 3 and as_model == 0
