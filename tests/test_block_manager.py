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
    free = list(bm.free_ids) + list(bm.evictable)
    assert len(free) == len(set(free)), "a block is free twice (or clean and cached at once)"
    for block_id in range(bm.num_blocks):
        assert bm.ref_counts[block_id] == held[block_id], f"block {block_id} refcount drifted"
        assert (block_id in set(free)) == (held[block_id] == 0), f"block {block_id} leaked"
        cached = bm.block_hash[block_id]
        assert (block_id in bm.evictable) <= (cached is not None), "an unindexed block is cached"
        if cached is not None:
            assert bm.hash_to_block[cached] == block_id, "the hash index points elsewhere"
    assert len(bm.hash_to_block) == sum(h is not None for h in bm.block_hash)
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


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 6)),
                     min_size=1, max_size=10),
    num_blocks=st.integers(6, 24),
    budget=st.integers(4, 64),
)
def test_prefix_cache_shares_blocks_without_breaking_counts(prompts, num_blocks, budget):
    """Requests built from a few shared stems: sharing, LRU eviction and preemption together."""
    from engine.prefix_cache import PrefixCache

    block_size = 4
    bm = BlockManager(num_blocks, block_size)
    cache = PrefixCache(bm)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget, prefix_cache=cache)
    stems = [list(range(100 * s, 100 * s + 24)) for s in range(4)]
    seqs = []
    for i, (stem, extra, max_tokens) in enumerate(prompts):
        prompt = stems[stem][: 4 + extra % 20] + [7000 + i] * (extra % 5)
        if len(prompt) + max_tokens <= num_blocks * block_size:
            seqs.append(Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens), 0.0))
    for seq in seqs:
        sched.add(seq)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            cache.register(s.seq)
            if s.samples:
                s.seq.output_token_ids.append(1)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    sched.finish(s.seq, "length")
        check_invariants(bm, seqs)
    assert not sched.has_unfinished(), "the scheduler stalled"
    assert bm.num_free_blocks == num_blocks
    assert cache.counters.hits <= cache.counters.queries


def _filled(cache, bm, rid: str, tokens: list[int]) -> Sequence:
    """A sequence whose tokens are all computed into blocks and indexed by the cache."""
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=1), 0.0)
    bm.append_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    cache.register(seq)
    return seq


def test_blocks_whose_old_hashes_collide_are_never_shared():
    """Python's hash() of an int is the int modulo 2**61 - 1, so under the old chained hash these
    two prompts had the very same block identities; the cryptographic chain tells them apart,
    and a hit is checked against the block's tokens as well."""
    from engine.prefix_cache import PrefixCache, block_hashes

    modulus = 2**61 - 1
    a = list(range(8)) + [5]
    b = [t + modulus for t in range(8)] + [5]  # a different prompt
    old = lambda tokens: hash((0, tuple(tokens[:4])))  # noqa: E731 - the replaced scheme
    assert old(a) == old(b)
    bm = BlockManager(8, 4)
    cache = PrefixCache(bm, "model|float32")
    _filled(cache, bm, "a", a)
    assert block_hashes(a, 4, 2, cache.root) != block_hashes(b, 4, 2, cache.root)
    victim = Sequence("b", b, SamplingParams(max_tokens=1), 0.0)
    assert cache.match(victim) == 0 and victim.block_table == []
    # Even a digest that did collide would not share: the tokens are compared on a hit.
    forged = Sequence("c", b, SamplingParams(max_tokens=1), 0.0)
    digest = block_hashes(a, 4, 1, cache.root)[0]
    import engine.prefix_cache as pc

    real = pc.block_hashes
    try:
        pc.block_hashes = lambda tokens, bs, count, root=b"": [digest] * count
        assert cache.match(forged) == 0 and forged.block_table == []
    finally:
        pc.block_hashes = real
    same = Sequence("d", list(a), SamplingParams(max_tokens=1), 0.0)
    assert cache.match(same) == 8  # the genuine prefix is still shared


def test_block_identity_covers_what_makes_the_kv_differ():
    from engine.prefix_cache import PrefixCache, block_hashes

    tokens = list(range(12))
    f32 = PrefixCache(BlockManager(4, 4), "model.gguf|torch.float32|float|auto")
    bf16 = PrefixCache(BlockManager(4, 4), "model.gguf|torch.bfloat16|float|auto")
    int8kv = PrefixCache(BlockManager(4, 4), "model.gguf|torch.float32|float|int8")
    digests = [block_hashes(tokens, 4, 3, c.root) for c in (f32, bf16, int8kv)]
    assert len({d[0] for d in digests}) == 3
    assert all(len(h) == 32 for h in digests[0])  # SHA-256
    changed = block_hashes([99] + tokens[1:], 4, 3, f32.root)
    assert all(x != y for x, y in zip(changed, digests[0], strict=True))  # the chain carries it


def test_drafts_never_preempt_another_request():
    """A sequence's speculative drafts ride along only where free blocks hold them: with the
    pool full, it decodes its one token and the other request keeps running."""
    from engine.spec.state import SpecState

    block_size = 4
    bm = BlockManager(4, block_size)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    first, second = _seq(0, 7, 8), _seq(1, 7, 8)  # 2 blocks each: the pool is full
    for seq in (first, second):
        sched.add(seq)
    for s in sched.schedule().scheduled:  # both prompts prefill
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.output_token_ids.append(0)
    assert bm.num_free_blocks == 0
    first.spec = SpecState()
    first.spec.tokens = [5, 6, 7, 8, 9]  # 1 + 5 tokens need 2 more blocks than it holds
    plan = sched.schedule()
    assert not plan.preempted and second in sched.running
    assert [(s.seq, s.num_new_tokens, s.num_draft) for s in plan.scheduled] == \
        [(first, 1, 0), (second, 1, 0)]
