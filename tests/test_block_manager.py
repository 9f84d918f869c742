"""Block manager and scheduler invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status


def _seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(str(i), list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    held = Counter(b for s in seqs for b in s.block_table)
    free = list(bm.free_ids)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    for block_id in range(bm.num_blocks):
        assert bm.ref_counts[block_id] == held[block_id], f"block {block_id} refcount drifted"
        assert (block_id in set(free)) == (held[block_id] == 0), f"block {block_id} leaked"
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


ops = st.lists(
    st.tuples(st.sampled_from(["append", "free", "share", "grow"]), st.integers(0, 5),
              st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), script=ops)
def test_random_allocate_append_share_free_keeps_counts(num_blocks, block_size, script):
    bm = BlockManager(num_blocks, block_size)
    seqs = [_seq(i, 1) for i in range(6)]
    for op, i, n in script:
        seq = seqs[i]
        if op in ("append", "grow"):
            if bm.can_append(seq, n):
                bm.append_slots(seq, n)
                seq.num_computed_tokens += n
                assert len(seq.block_table) * block_size >= seq.num_computed_tokens
        elif op == "free":
            bm.free(seq)
            seq.num_computed_tokens = 0
        elif op == "share":
            donor = seqs[(i + 1) % len(seqs)]
            full = donor.num_computed_tokens // block_size
            if full and not seq.block_table:
                bm.share(seq, donor.block_table[:full])
                seq.num_computed_tokens = full * block_size
        check_invariants(bm, seqs)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=10),
    num_blocks=st.integers(4, 20),
    budget=st.integers(4, 64),
    max_seqs=st.integers(1, 8),
)
def test_scheduler_finishes_everything_with_preemption(lengths, num_blocks, budget, max_seqs):
    """Simulate the engine loop without a model: every request completes and no block leaks."""
    block_size = 4
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    capacity = num_blocks * block_size
    seqs = [_seq(i, p, m) for i, (p, m) in enumerate(lengths) if p + m <= capacity]
    for seq in seqs:
        sched.add(seq)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        assert plan.scheduled or not sched.running, "running sequences but nothing scheduled"
        assert plan.num_tokens <= budget
        assert len(sched.running) <= max_seqs
        for s in plan.scheduled:
            sampled = s.samples
            s.seq.num_computed_tokens += s.num_new_tokens
            assert len(s.seq.block_table) * block_size >= s.seq.num_computed_tokens
            if sampled:
                s.seq.output_token_ids.append(0)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    sched.finish(s.seq, "length")
        check_invariants(bm, seqs)
    assert not sched.has_unfinished(), "the scheduler stalled"
    assert all(s.status is Status.FINISHED for s in seqs)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks
