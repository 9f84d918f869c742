"""n > 1: later choices share the first choice's full prompt blocks instead of recomputing them."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPT = ("Write three different one-line slogans for a bakery that opens at dawn and sells "
          "bread, cakes and coffee to the people of a small harbour town. " * 3)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048)


def run(llm, ids):
    outputs = {}
    while llm.has_unfinished():
        for out in llm.step()[0]:
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return [outputs[i] for i in ids]


def test_a_fork_shares_the_full_prompt_blocks_and_gives_the_same_tokens(llm):
    expected = llm.generate([PROMPT], GREEDY)[0].token_ids
    a = llm.add_request(PROMPT, GREEDY)
    b = llm.add_request(PROMPT, GREEDY, share_prompt_with=a)
    llm.step()  # a computes the prompt; b waits for it
    seq_a, seq_b = llm.sequence(a), llm.sequence(b)
    assert seq_b.block_table == []
    llm.step()
    full = (len(seq_a.prompt_token_ids) - 1) // llm.block_size
    assert full >= 4
    assert seq_b.block_table[:full] == seq_a.block_table[:full]
    assert seq_b.block_table[full] != seq_a.block_table[full]  # its own last, partial block
    assert all(llm.block_manager.ref_counts[blk] == 2 for blk in seq_a.block_table[:full])
    assert run(llm, [a, b]) == [expected, expected]
    assert llm.block_manager.num_used_blocks == 0


def test_forks_hold_fewer_blocks_than_separate_choices(llm):
    def peak(share: bool) -> int:
        first = llm.add_request(PROMPT, GREEDY)
        for _ in range(3):
            llm.add_request(PROMPT, GREEDY, share_prompt_with=first if share else None)
        most = 0
        while llm.has_unfinished():
            llm.step()
            most = max(most, llm.block_manager.num_used_blocks)
        return most

    separate, shared = peak(False), peak(True)
    full = (len(llm.tokenizer.encode(PROMPT)) - 1) // llm.block_size
    assert separate - shared >= 3 * full - 3


def test_a_fork_whose_source_has_finished_computes_alone(demo_gguf):
    # One sequence at a time: the fork is admitted only after its source has gone.
    one = LLM(str(demo_gguf), device="cpu", kv_cache_tokens=2048, max_num_seqs=1)
    expected = one.generate([PROMPT], GREEDY)[0].token_ids
    a = one.add_request(PROMPT, GREEDY)
    b = one.add_request(PROMPT, GREEDY, share_prompt_with=a)
    assert run(one, [a, b]) == [expected, expected]
    assert one.block_manager.num_used_blocks == 0


def test_another_prompt_is_never_shared(llm):
    a = llm.add_request(PROMPT, GREEDY)
    b = llm.add_request(PROMPT + " Now in French.", GREEDY, share_prompt_with=a)
    assert llm.sequence(b).prompt_source is None
    run(llm, [a, b])
