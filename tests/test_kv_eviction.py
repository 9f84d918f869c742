"""KV-cache eviction: selection, compaction, rotary re-positioning, block accounting, quality."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_eval import evaluate_policies
from engine.kv_eviction import KVEvictor, KVState, SnapKV, parse_policy, resolve_budget
from engine.llm import LLM
from engine.model import LlamaModel
from engine.prefix_cache import PrefixCache
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import RequestError, SamplingParams, Sequence, Status
from kernels import reference
from tests.test_block_manager import check_invariants

TEXT = "assets/texts/python-reference.txt"


def _tiny_runner(num_blocks: int, block_size: int, layers: int = 2, kv_heads: int = 2,
                 dtype: torch.dtype = torch.float32):
    """A real model runner over a tiny random Llama (the runner's cache and rotary tables)."""
    c = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                    num_layers=layers, num_heads=4, num_kv_heads=kv_heads, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * 0.2  # noqa: E731
    t = {"model.embed_tokens.weight": rnd(64, 32), "model.norm.weight": torch.ones(32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(32),
              p + "post_attention_layernorm.weight": torch.ones(32),
              p + "self_attn.q_proj.weight": rnd(32, 32),
              p + "self_attn.k_proj.weight": rnd(kv_heads * 8, 32),
              p + "self_attn.v_proj.weight": rnd(kv_heads * 8, 32),
              p + "self_attn.o_proj.weight": rnd(32, 32),
              p + "mlp.gate_proj.weight": rnd(48, 32), p + "mlp.up_proj.weight": rnd(48, 32),
              p + "mlp.down_proj.weight": rnd(32, 48)}
    model = LlamaModel(c, t, torch.device("cpu"), dtype, 1024, "reference")
    bm = BlockManager(num_blocks, block_size)
    return ModelRunner(model, bm), bm


def test_policy_and_budget_parsing_errors_name_the_input():
    assert parse_policy("none") is None and parse_policy(None) is None
    assert parse_policy("StreamingLLM").name == "streaming"
    with pytest.raises(RequestError, match="Unknown KV eviction policy 'lru'"):
        parse_policy("lru")
    assert resolve_budget(0.25, 400, 16) == 100
    assert resolve_budget(0.25, 40, 16) == 32  # a fraction of a short request: the minimum
    assert resolve_budget(64, 400, 16) == 64
    with pytest.raises(RequestError, match="needs kv_budget"):
        resolve_budget(None, 400, 16)
    with pytest.raises(RequestError, match=r"in \(0, 1\]"):
        resolve_budget(1.5, 400, 16)
    with pytest.raises(RequestError, match="below the minimum of 32"):
        resolve_budget(20, 400, 16)


def test_move_kv_copies_each_layer_and_heads_own_tokens():
    runner, _ = _tiny_runner(8, 4)
    runner.kv.copy_(torch.randn_like(runner.kv))
    before = runner.kv.clone()
    src = torch.tensor([[[9, 3, 17], [1, 2, 30]], [[5, 6, 7], [0, 11, 12]]])  # [layers, heads, 3]
    dst = torch.tensor([0, 1, 2])
    runner.move_kv(src, dst, None)
    for layer in range(2):
        for head in range(2):
            for j in range(3):
                torch.testing.assert_close(runner.kv[layer, :, dst[j], head],
                                           before[layer, :, src[layer, head, j], head])


def test_rerotating_a_cached_key_equals_computing_it_at_the_new_position():
    runner, _ = _tiny_runner(8, 4)
    model = runner.model
    k_raw = torch.randn(5, 2, 8)
    old = torch.tensor([40, 41, 97, 300, 301])
    new = torch.tensor([4, 5, 6, 7, 8])
    q0 = torch.zeros(5, 4, 8)
    _, k_old = reference.rotary(q0, k_raw, model.cos[old], model.sin[old])
    _, k_new = reference.rotary(q0, k_raw, model.cos[new], model.sin[new])
    moved = runner._rotate(k_old.transpose(0, 1), new - old).transpose(0, 1)
    torch.testing.assert_close(moved, k_new, atol=1e-5, rtol=1e-5)


def test_rerotating_a_half_precision_key_many_times_does_not_compound_rounding():
    """StreamingLLM re-rotates a kept key at every compaction while it stays in the window (60
    times for a 1,000-token window of 16-token blocks): in bfloat16 the result must stay as
    close to the key computed at its final position as one rounding allows, not drift."""
    runner, _ = _tiny_runner(8, 4, dtype=torch.bfloat16)
    from engine.rope import cos_sin_tables

    cos, sin = cos_sin_tables(runner.model.inv_freq, 1024)
    k_raw = torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(0))
    q0 = torch.zeros(64, 4, 8)
    at = lambda p: reference.rotary(q0, k_raw, cos[[p] * 64], sin[[p] * 64])[1]  # noqa: E731
    k = at(1000).to(torch.bfloat16).transpose(0, 1)
    for _ in range(60):
        k = runner._rotate(k, torch.full((64,), -16))
    want = at(1000 - 60 * 16)
    error = (k.float().transpose(0, 1) - want).norm() / want.norm()
    assert error < 0.02  # one bfloat16 rounding is 0.4%; compounding through bf16 tables, 4%


def test_h2o_keeps_each_heads_heaviest_tokens_and_the_recent_window():
    runner, bm = _tiny_runner(16, 4, layers=1, kv_heads=2)
    evictor = KVEvictor(runner, bm)
    seq = Sequence("a", list(range(20)), SamplingParams(max_tokens=4), 0.0)
    bm.append_slots(seq, 20)
    seq.num_computed_tokens = 20
    seq.kv = KVState(parse_policy("h2o"), budget=8)
    scores = torch.zeros(1, 2, 20)
    scores[0, 0, [2, 5, 9, 11]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    scores[0, 1, [0, 7, 8, 13]] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    seq.kv.scores = scores
    chosen = seq.kv.policy.select(seq.kv, 0, seq.kv_len, 8, evictor._score_shape(), False)
    assert chosen[0, 0].tolist() == [2, 5, 9, 11, 16, 17, 18, 19]
    assert chosen[0, 1].tolist() == [0, 7, 8, 13, 16, 17, 18, 19]
    runner.kv.copy_(torch.randn_like(runner.kv))
    before, old_table = runner.kv.clone(), list(seq.block_table)
    assert evictor.maybe_compact(seq) == 12
    assert seq.kv_len == 8 and len(seq.block_table) == 2 and seq.position_offset == 12
    assert bm.num_used_blocks == 2 and seq.block_table == old_table[:2]
    for head in range(2):
        for j, src in enumerate(chosen[0, head].tolist()):
            torch.testing.assert_close(runner.kv[0, :, old_table[j // 4] * 4 + j % 4, head],
                                       before[0, :, old_table[src // 4] * 4 + src % 4, head])
    # The scores travel with their tokens.
    assert seq.kv.scores[0, 0, :4].tolist() == [4.0, 3.0, 2.0, 1.0]


def test_streaming_keeps_sinks_and_window_and_repositions():
    runner, bm = _tiny_runner(16, 4, layers=1)
    evictor = KVEvictor(runner, bm)
    seq = Sequence("a", list(range(30)), SamplingParams(max_tokens=4), 0.0)
    bm.append_slots(seq, 30)
    seq.num_computed_tokens = 30
    seq.kv = KVState(parse_policy("streaming"), budget=12)
    kept = seq.kv.policy.select(seq.kv, 0, seq.kv_len, 12, evictor._score_shape(), False)
    assert kept[0, 0].tolist() == [0, 1, 2, 3] + list(range(22, 30))
    assert evictor.maybe_compact(seq) == 18
    assert seq.kv_len == 12 and seq.position_offset == 0 and bm.num_used_blocks == 3


ops = st.lists(st.tuples(st.sampled_from(["step", "abort", "add"]), st.integers(0, 7)),
               min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(script=ops, num_blocks=st.integers(8, 24), policy=st.sampled_from(
    ["streaming", "h2o", "scissorhands", "snapkv"]), budget=st.sampled_from([8, 12, 20]))
def test_block_pool_never_leaks_under_sharing_eviction_preemption_and_aborts(
        script, num_blocks, policy, budget):
    """The engine loop without sampling: shared prefixes, evictions, preemptions and aborts."""
    block_size = 4
    runner, bm = _tiny_runner(num_blocks, block_size, layers=1)
    cache = PrefixCache(bm)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, prefix_cache=cache)
    evictor = KVEvictor(runner, bm)
    gen = torch.Generator().manual_seed(len(script))
    stem = list(range(100, 124))
    seqs: list[Sequence] = []
    for op, i in script:
        if op == "add" or not seqs:
            evicting = i % 2 == 0
            prompt = stem[: 8 + i] + [1000 + len(seqs)] * (i % 3)
            seq = Sequence(str(len(seqs)), prompt, SamplingParams(max_tokens=6 + i), 0.0)
            seq.kv = KVState(parse_policy(policy), budget) if evicting else None
            seqs.append(seq)
            sched.add(seq)
        elif op == "abort":
            seq = seqs[i % len(seqs)]
            if seq.status is not Status.FINISHED:
                sched.finish(seq, "abort")
        else:
            plan = sched.schedule()
            for s in plan.scheduled:
                s.seq.num_computed_tokens += s.num_new_tokens
                if s.seq.kv is None:
                    cache.register(s.seq)
                if s.samples:
                    s.seq.output_token_ids.append(7)
                    if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                        sched.finish(s.seq, "length")
                        continue
                if s.seq.kv is not None:
                    mass = torch.rand(1, 2, s.seq.kv_len, generator=gen)
                    shared = list(s.seq.block_table[: s.seq.num_cached_blocks])
                    evictor.observe(s.seq, mass)
                    evictor.maybe_compact(s.seq)
                    assert s.seq.block_table[: len(shared)] == shared, "a shared block moved"
                    assert len(s.seq.block_table) * block_size >= s.seq.kv_len
        check_invariants(bm, seqs)
        for seq in seqs:
            if seq.kv is not None and seq.status is Status.RUNNING:
                # The cache stays within budget + a block (+ one prefill chunk before compaction).
                assert seq.kv_len <= max(budget, seq.num_cached_blocks * block_size) + 4 + 16
    for seq in seqs:
        if seq.status is not Status.FINISHED:
            sched.finish(seq, "abort")
    check_invariants(bm, seqs)
    assert bm.num_free_blocks == num_blocks


# ---- the real demo model ----

@pytest.fixture(scope="module")
def llm(demo_gguf) -> LLM:
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=4096, max_num_seqs=8,
               max_model_len=1024, prefix_caching=True)


@pytest.fixture(scope="module")
def text_ids(llm) -> list[int]:
    with open(TEXT, encoding="utf-8") as f:
        return llm.tokenizer.encode(f.read())


def test_tokens_before_the_first_compaction_match_the_full_cache(llm, text_ids):
    prompt = text_ids[:60]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for policy in ("streaming", "h2o", "scissorhands"):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                    kv_policy=policy, kv_budget=48))
        # 60 prompt tokens > 48 + 16: the prompt is compacted at once, so compare with the budget
        # large enough that the first compaction comes after 20 generated tokens.
        late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                     ignore_eos=True, kv_policy=policy,
                                                     kv_budget=64))
        assert late[0].token_ids[:20] == full[0].token_ids[:20], policy
        assert len(out[0].token_ids) == 40


def test_teacher_forced_quality_is_measured_against_the_full_cache(llm, text_ids):
    ids = text_ids[:260]
    scores = evaluate_policies(llm, ids, 100, [("h2o", 1.0), ("streaming", 0.4), ("h2o", 0.4)])
    full, unevicted, streaming, h2o = scores
    assert full.policy == "none" and full.top1_agreement is None
    assert 2.0 < full.perplexity < 60.0  # a real model on real English
    # A budget of the whole request evicts nothing and changes nothing.
    assert unevicted.tokens_evicted == 0 and unevicted.top1_agreement == 1.0
    assert unevicted.perplexity == pytest.approx(full.perplexity, rel=1e-4)
    for s in (streaming, h2o):
        assert s.budget_tokens == 104 and s.tokens_evicted > 0
        assert s.peak_kv_tokens <= 104 + 16 + 100  # budget + a block (+ the prompt chunk)
        assert s.final_kv_tokens <= 104 + 16
        assert 0.5 < s.top1_agreement < 1.0
        assert full.perplexity * 0.8 < s.perplexity < full.perplexity * 2.0


def test_streaming_generates_past_the_context_length(demo_gguf):
    # (A 64-token context keeps the run short: 100 tokens already go well past it.)
    small = LLM(str(demo_gguf), device="cpu", max_model_len=64, max_num_batched_tokens=32,
                kv_cache_tokens=512)
    out = small.generate(["Count from one to two hundred: one, two, three,"],
                         SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                        kv_policy="streaming", kv_budget=32))[0]
    assert len(out.token_ids) == 100 and out.finish_reason == "length"
    assert small.evictor.tokens_evicted > 50
    # Policies that keep original positions stop at the context length, as without eviction.
    h2o = small.generate(["hello " * 10], SamplingParams(max_tokens=150, kv_policy="h2o",
                                                         kv_budget=32, ignore_eos=True))[0]
    assert h2o.finish_reason == "length"
    assert len(h2o.prompt_token_ids) + len(h2o.token_ids) == 64
    assert small.block_manager.num_used_blocks == 0


def test_shared_prefix_blocks_are_never_moved(llm, text_ids):
    prompt = text_ids[:70]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # caches the prefix
    cached = [llm.block_manager.cached_block(h) for h in
              __import__("engine.prefix_cache", fromlist=["x"]).block_hashes(
                  prompt, 16, 4, llm.prefix_cache.root)]
    assert all(b is not None for b in cached)
    snapshot = llm.runner.kv[:, :, [b * 16 + j for b in cached for j in range(16)]].clone()
    plain = llm.generate([prompt + [13]], SamplingParams(temperature=0, max_tokens=30))[0]
    evicting = llm.generate([prompt + [13]], SamplingParams(temperature=0, max_tokens=30,
                                                            kv_policy="h2o", kv_budget=72))[0]
    after = llm.runner.kv[:, :, [b * 16 + j for b in cached for j in range(16)]]
    assert torch.equal(snapshot, after), "eviction wrote into blocks shared by the prefix cache"
    assert plain.token_ids[:5] == evicting.token_ids[:5]


def test_draft_model_with_eviction_is_refused(demo_gguf):
    with pytest.raises(RequestError, match="draft model"):
        LLM(str(demo_gguf), device="cpu", speculative=f"draft:{demo_gguf}", kv_policy="h2o",
            kv_budget=64, kv_cache_tokens=1024)


def test_ngram_speculation_with_eviction_keeps_greedy_output(llm, text_ids):
    spec = LLM(llm.model_path, device="cpu", speculative="ngram", kv_cache_tokens=2048,
               max_model_len=1024)
    prompt = text_ids[:40] * 2
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, kv_policy="streaming",
                            kv_budget=48)
    with_spec = spec.generate([prompt], params)[0].token_ids
    assert spec.evictor.tokens_evicted > 0 and spec.spec.counters.accepted_tokens > 0
    # Both compact the prompt alike; the first tokens come before any later compaction. (The
    # module's engine shares prefixes, which protects blocks from eviction: compare without.)
    plain = LLM(llm.model_path, device="cpu", kv_cache_tokens=2048, max_model_len=1024)
    assert with_spec[:12] == plain.generate([prompt], params)[0].token_ids[:12]


# ---- oracle: compaction and positions against a dense forward that masks per layer and head ----

def _dense_last_token(model, prompt: list[int], token: int, kept: torch.Tensor,
                      key_pos: torch.Tensor, q_pos: int) -> tuple[torch.Tensor, list]:
    """Logits of `token` after `prompt`, computed densely: the prompt attends causally at its
    true positions (its K/V are what the cache held before compaction), and at layer l the new
    token's query heads of KV head h attend only to prompt tokens kept[l, h] (whose keys are
    rotated to key_pos[l, h]) and to itself at q_pos. Also each layer's attention probabilities
    of the new token over [kept tokens, itself], summed per KV head ([Hkv, keep + 1])."""
    c = model.config
    group = c.num_heads // c.num_kv_heads
    n = len(prompt)
    ids = torch.tensor(prompt + [token])
    pos = torch.arange(n + 1)
    pos[n] = q_pos
    h = torch.nn.functional.embedding(ids, model.embed)
    residual, probs_per_layer = None, []
    for li, layer in enumerate(model.layers):
        x, residual = reference.rms_norm(h, layer.input_norm, c.rms_norm_eps, residual)
        q, k, v = reference.linear(x, layer.qkv).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            dim=-1)
        q, k, v = (t.reshape(n + 1, -1, c.head_dim) for t in (q, k, v))
        k_raw = k.clone()
        q, k = reference.rotary(q, k, model.cos[pos], model.sin[pos])
        out = torch.empty_like(q)
        # The prompt rows: plain causal attention.
        for head in range(c.num_heads):
            kh = head // group
            s = (q[:n, head] @ k[:n, kh].T) * model.scale
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            out[:n, head] = s.softmax(-1) @ v[:n, kh]
        # The new token: per KV head, its kept keys re-rotated to key_pos, then itself.
        layer_probs = []
        for kh in range(c.num_kv_heads):
            idx, kp = kept[li, kh], key_pos[li, kh]
            _, keys = reference.rotary(q[:1, :1], k_raw[idx, kh : kh + 1], model.cos[kp],
                                       model.sin[kp])
            keys = torch.cat((keys[:, 0], k[n : n + 1, kh]))
            vals = torch.cat((v[idx, kh], v[n : n + 1, kh]))
            p = ((q[n, kh * group : (kh + 1) * group] @ keys.T) * model.scale).softmax(-1)
            out[n, kh * group : (kh + 1) * group] = p @ vals
            layer_probs.append(p.sum(0))
        probs_per_layer.append(torch.stack(layer_probs))
        h = reference.linear(out.reshape(n + 1, -1), layer.o)
        x, residual = reference.rms_norm(h, layer.post_norm, c.rms_norm_eps, residual)
        h = reference.linear(reference.silu_and_mul(reference.linear(x, layer.gate_up)),
                             layer.down)
    h, _ = reference.rms_norm(h, model.norm, c.rms_norm_eps, residual)
    return model.logits(h[n : n + 1])[0], probs_per_layer


def _prefilled(runner, bm, evictor, rid: str, prompt: list[int], kv: KVState | None):
    """A sequence whose prompt was run through the runner (mass observed, compacted)."""
    from engine.runner import RunItem

    seq = Sequence(rid, prompt, SamplingParams(max_tokens=4), 0.0)
    seq.kv = kv
    bm.append_slots(seq, len(prompt))
    rows = None if kv is None else kv.policy.mass_rows(seq, len(prompt))
    result = runner.run_items([RunItem(prompt, 0, seq.block_table, 1, mass_rows=rows)],
                              want_mass=True)
    seq.num_computed_tokens = len(prompt)
    if kv is not None:
        evictor.observe(seq, result.mass[0])
    return seq


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "snapkv", "streaming"])
def test_next_token_after_compaction_equals_a_dense_forward_over_the_kept_tokens(policy):
    """The strongest check of compaction: after the cache is compacted per layer and KV head,
    the next decode step (batched with another sequence's prefill chunk and a plain decode)
    gives the logits and attention mass of a dense forward in which each layer and head sees
    only what it kept, at the original positions (streaming: at the new cache indices)."""
    from engine.runner import RunItem

    runner, bm = _tiny_runner(32, 4, layers=2, kv_heads=2)
    evictor = KVEvictor(runner, bm)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(64, (22,), generator=gen).tolist()
    other = torch.randint(64, (9,), generator=gen).tolist()
    # SnapKV with a 2-query window: of the 4 prompt tokens it keeps, 2 are heavy hitters.
    rule = SnapKV(window=2) if policy == "snapkv" else parse_policy(policy)
    a = _prefilled(runner, bm, evictor, "a", prompt, KVState(rule, budget=8))
    plain = _prefilled(runner, bm, evictor, "c", other, None)
    if policy in ("h2o", "scissorhands"):  # as if after a history in which heads disagree
        a.kv.scores += torch.rand(a.kv.scores.shape, generator=gen)
    keep = 8 if policy != "snapkv" else 4  # SnapKV: half the budget for the prompt
    scores = None if a.kv.scores is None else a.kv.scores.clone()
    state_before = KVState(a.kv.policy, a.kv.budget, scores=scores)
    probe = Sequence("p", prompt, SamplingParams(), 0.0)
    probe.num_computed_tokens, probe.kv, probe.block_table = 22, state_before, a.block_table
    if policy == "snapkv":
        state_before.snapped, state_before.prompt_kept = True, keep
    kept = state_before.policy.select(state_before, 0, probe.kv_len, keep,
                                      evictor._score_shape(), snapshot=policy == "snapkv")
    assert evictor.maybe_compact(a) == 22 - keep and a.kv_len == keep
    if policy != "streaming":  # the layers and heads keep different tokens
        assert len({tuple(r) for r in kept.reshape(-1, keep).tolist()}) > 1
    # The next step: a fresh prefill chunk first, then the evicted decode, then a plain decode.
    fresh = Sequence("b", other[:6], SamplingParams(), 0.0)
    bm.append_slots(fresh, 6)
    bm.append_slots(a, 1)
    bm.append_slots(plain, 1)
    token, token_c = 5, 11
    items = [RunItem(other[:6], 0, fresh.block_table, 1),
             RunItem([token], a.kv_len, a.block_table, 1, a.position_offset),
             RunItem([token_c], plain.kv_len, plain.block_table, 1)]
    result = runner.run_items(items, want_mass=True)
    logits = result.logits
    if policy == "streaming":
        key_pos, q_pos = torch.arange(keep).expand_as(kept), keep
    else:
        key_pos, q_pos = kept, len(prompt)
    want, probs = _dense_last_token(runner.model, prompt, token, kept, key_pos, q_pos)
    torch.testing.assert_close(logits[1], want, atol=1e-5, rtol=1e-5)
    mass = result.mass[1]  # [layers, kv_heads, keep + 1], the evicted sequence's own
    assert mass.shape == (2, 2, keep + 1)
    torch.testing.assert_close(mass, torch.stack(probs), atol=1e-5, rtol=1e-5)
    all_kept = torch.arange(len(other)).expand(2, 2, len(other))
    want_c, probs_c = _dense_last_token(runner.model, other, token_c, all_kept, all_kept,
                                        len(other))
    torch.testing.assert_close(logits[2], want_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.mass[2], torch.stack(probs_c), atol=1e-5, rtol=1e-5)
    assert result.mass[0].shape == (2, 2, 6)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "scissorhands", "streaming"])
def test_a_budget_below_the_shared_prefix_keeps_running(policy):
    """A request whose prefix-cache hit is longer than its budget: the shared blocks stay, and
    every policy keeps compacting its private tokens step after step without failing."""
    runner, bm = _tiny_runner(32, 4, layers=1)
    cache = PrefixCache(bm)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, prefix_cache=cache)
    evictor = KVEvictor(runner, bm)
    prompt = list(range(1, 21))
    first = Sequence("warm", prompt, SamplingParams(max_tokens=1), 0.0)
    sched.add(first)
    for s in sched.schedule().scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        cache.register(s.seq)
    sched.finish(first, "length")
    seq = Sequence("a", prompt + [30], SamplingParams(max_tokens=12), 0.0)
    seq.kv = KVState(parse_policy(policy), budget=8)
    sched.add(seq)
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        plan = sched.schedule()
        assert [s.seq for s in plan.scheduled] == [seq]
        seq.num_computed_tokens += plan.scheduled[0].num_new_tokens
        if step == 0:
            assert seq.num_cached_blocks == 5  # 20 shared tokens, more than the budget of 8
            first_blocks = list(seq.block_table[:5])
        seq.output_token_ids.append(7)
        evictor.observe(seq, torch.rand(1, 2, seq.kv_len, generator=gen))
        evictor.maybe_compact(seq)
        assert 20 <= seq.kv_len <= 20 + 4 + 1 and len(seq.block_table) * 4 >= seq.kv_len
    # Compaction comes once per block of growth, not at every step.
    assert seq.kv.compactions <= 4 and seq.block_table[:5] == first_blocks
    check_invariants(bm, [seq])


def test_a_preempted_streaming_request_past_the_context_recomputes_within_it(demo_gguf):
    """Preemption recomputes a sequence from its first token, outputs included: for
    StreamingLLM, which may have run past the context length, that recompute must still come
    in chunks the cache and the rotary table hold (not all its tokens at once)."""
    small = LLM(str(demo_gguf), device="cpu", max_model_len=64, kv_cache_tokens=512)
    rid = small.add_request("Count: one, two, three,", SamplingParams(
        temperature=0, max_tokens=80, ignore_eos=True, kv_policy="streaming", kv_budget=32))
    seq = small.sequence(rid)
    while len(seq.output_token_ids) < 70:
        small.step()
    small.scheduler.preempt(seq)  # what the scheduler does when the pool runs dry
    while not seq.is_finished:
        small.step()
        assert seq.kv_len < 64
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 80
    assert small.block_manager.num_used_blocks == 0


def test_rejected_drafts_blocks_are_freed_after_eviction(demo_gguf, text_ids):
    """After verification a sequence keeps the blocks its cached tokens need (plus the next
    token's), also once tokens were evicted (cached = computed - evicted)."""
    spec = LLM(str(demo_gguf), device="cpu", speculative="ngram", kv_cache_tokens=1024,
               max_model_len=1024, block_size=4)
    rid = spec.add_request(text_ids[:40] * 2, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, kv_policy="h2o", kv_budget=48))
    seq = spec.sequence(rid)
    checked = 0
    while not seq.is_finished:
        _, stats = spec.step()
        if stats.num_draft_tokens > stats.num_accepted_tokens and not seq.is_finished:
            assert len(seq.block_table) <= spec.block_manager.blocks_needed(seq.kv_len + 1)
            checked += 1
    assert checked > 0 and seq.num_evicted > 0


def test_snapkv_observes_its_whole_window_when_the_prompt_ends_in_a_tiny_chunk():
    """SnapKV's observation window is the prompt's last `window` queries however the prompt was
    chunked: a prompt whose last chunk has 3 tokens must not snap on 3 queries' attention."""
    from engine.scheduler import ScheduledSeq

    prompt = torch.randint(64, (40,), generator=torch.Generator().manual_seed(5)).tolist()

    def snapshot_scores(chunks: list[int]) -> torch.Tensor:
        runner, bm = _tiny_runner(32, 4, layers=2)
        evictor = KVEvictor(runner, bm)
        seq = Sequence("a", prompt, SamplingParams(), 0.0)
        seq.kv = KVState(SnapKV(window=8), budget=32)
        for n in chunks:
            bm.append_slots(seq, n)
            result = runner.run([ScheduledSeq(seq, n)], want_mass=True)
            seq.num_computed_tokens += n
            evictor.observe(seq, result.mass[0])
        return seq.kv.scores

    whole = snapshot_scores([40])
    assert whole.shape == (2, 2, 40)
    for chunks in ([37, 3], [20, 19, 1], [30, 10]):
        torch.testing.assert_close(snapshot_scores(chunks), whole, atol=1e-5, rtol=1e-5)


def test_speculative_drafts_stay_within_the_context(demo_gguf):
    """Speculative drafts ride as extra query tokens: under StreamingLLM (positions = cache
    indices) they must not carry the cache past the positions the context holds, nor, with
    true positions, past the context's end."""
    spec = LLM(str(demo_gguf), device="cpu", speculative="ngram:k=8,adaptive=0",
               max_model_len=64, kv_cache_tokens=512)
    prompt = spec.tokenizer.encode("one one one")
    assert len(prompt) < 9
    with pytest.raises(RequestError, match=r"a step's chunk of up to 9: prompt or speculative"):
        spec.add_request(prompt, SamplingParams(kv_policy="streaming", kv_budget=39))
    budget = 64 - 16 - 9 - 1  # the largest budget the context allows with 8 drafts a step
    out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                                 kv_policy="streaming", kv_budget=budget))[0]
    assert len(out.token_ids) == 100 and spec.spec.counters.draft_tokens > 0
    # Without eviction, or with a policy that keeps true positions, drafts near the end of the
    # context must not run past it either: the request stops at the context length.
    for policy in (None, "h2o"):
        out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=100,
                                                     ignore_eos=True, kv_policy=policy,
                                                     kv_budget=32))[0]
        assert out.finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.token_ids) == 64
