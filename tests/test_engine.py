"""The engine on the real demo model: batching is invisible, preemption, sampling, stops, errors."""

from __future__ import annotations

import threading

import pytest

from engine import LLM, SamplingParams
from engine.sequence import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at",
    "In machine learning, a transformer is a neural network architecture that",
    "Hello",
]


@pytest.fixture(scope="module")
def llm(demo_gguf) -> LLM:
    return LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=16)


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_greedy_answer_is_real_text(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].text.startswith(" Paris")
    assert out[0].finish_reason == "length"
    assert len(out[0].token_ids) == 4


def test_batching_is_invisible(llm, alone):
    together = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in together] == alone
    assert llm.block_manager.num_used_blocks == 0


def test_preemption_recomputes_and_outputs_match(demo_gguf, alone):
    # 8 requests need ~8 x 3 blocks of 16; a pool of 8 blocks forces preemption.
    small = LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=128, max_num_seqs=8)
    together = small.generate(PROMPTS, GREEDY)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in together] == alone
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_chunked_prefill_matches_whole_prefill(demo_gguf, llm):
    prompt = llm.tokenizer.encode(PROMPTS[6] * 6)
    chunked = LLM(str(demo_gguf), device="cpu", dtype="float32",
                  kv_cache_tokens=1024, max_num_batched_tokens=32)
    a = chunked.generate([prompt], GREEDY)[0].token_ids
    b = llm.generate([prompt], GREEDY)[0].token_ids
    assert a == b


def test_step_reports_stats_from_the_engine(llm):
    llm.add_request("Hello there", SamplingParams(temperature=0, max_tokens=3))
    outputs, stats = llm.step()
    assert stats.num_prefill_tokens == len(llm.tokenizer.encode("Hello there"))
    assert stats.num_decode_tokens == 0 and stats.num_generated_tokens == 1
    assert stats.num_running == 1 and stats.kv_blocks_used == 1
    assert stats.kv_blocks_total == llm.num_kv_blocks and stats.wall_s > 0
    outputs, stats = llm.step()
    assert stats.num_decode_tokens == 1 and stats.num_prefill_tokens == 0
    while llm.has_unfinished():
        outputs, stats = llm.step()
    out = outputs[0]
    m = out.metrics
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert m.arrival < m.first_token <= m.finished
    assert len(m.itl_s) == 2 and m.tpot_s == pytest.approx(sum(m.itl_s) / 2)
    assert m.ttft_s == pytest.approx(m.first_token - m.arrival)


def test_same_seed_same_text_alone_and_in_batch(llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=16, seed=1234,
                            ignore_eos=True)
    a = llm.generate([PROMPTS[2]], params)[0].token_ids
    b = llm.generate([PROMPTS[2]], params)[0].token_ids
    batch = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[5]], params)
    assert a == b == batch[1].token_ids
    other = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=16, seed=99,
                           ignore_eos=True)
    assert llm.generate([PROMPTS[2]], other)[0].token_ids != a


def test_top_k_one_is_greedy(llm, alone):
    params = SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True, seed=1)
    assert llm.generate([PROMPTS[0]], params)[0].token_ids == alone[0]


def test_stop_string_truncates_text(llm):
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=30, stop=["7"]))
    assert out[0].finish_reason == "stop"
    assert "7" not in out[0].text and out[0].text.strip().startswith("5")


def test_eos_stops_a_chat_reply(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}],
                   SamplingParams(temperature=0, max_tokens=200))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert out.text and "<|im_end|>" not in out.text


def test_stream_deltas_add_up_to_the_text(llm):
    deltas = list(llm.stream(PROMPTS[2], GREEDY))
    assert "".join(d.text for d in deltas) == deltas[-1].output.text
    assert sum(len(d.token_ids) for d in deltas) == 24
    assert deltas[-1].finish_reason == "length"


def test_closing_a_stream_aborts_the_request(llm):
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100))
    next(stream)
    stream.close()
    assert not llm.has_unfinished()
    assert llm.block_manager.num_used_blocks == 0


def test_abort_from_another_thread_frees_blocks(llm):
    rid = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200))
    other = llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5))
    llm.step()
    t = threading.Thread(target=llm.abort, args=(rid,))
    t.start()
    t.join()
    finished = {}
    while llm.has_unfinished():
        outputs, _ = llm.step()
        finished.update((o.request_id, o) for o in outputs if o.finished)
    assert finished[rid].finish_reason == "abort"
    assert finished[other].finish_reason == "length"
    assert llm.block_manager.num_used_blocks == 0


def test_token_id_prompts_and_prompt_logits(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    logits = llm.prompt_logits(ids)
    assert logits.shape == (len(ids), llm.config.vocab_size)
    greedy = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert greedy.token_ids[0] == int(logits[-1].argmax())


def test_prompt_longer_than_context_is_refused_and_others_continue(llm):
    running = llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(RequestError, match="context holds"):
        llm.add_request([1] * (llm.max_model_len + 5), GREEDY)
    with pytest.raises(RequestError, match="KV pool holds"):
        llm.add_request([1] * 100, SamplingParams(max_tokens=llm.kv_cache_tokens))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.add_request([llm.config.vocab_size + 3], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.add_request("", GREEDY)
    done = {}
    while llm.has_unfinished():
        outputs, _ = llm.step()
        done.update((o.request_id, o) for o in outputs if o.finished)
    assert done[running].finish_reason == "length"


def test_generate_names_the_bad_prompt(llm):
    with pytest.raises(RequestError, match="Prompt 1"):
        llm.generate(["fine", [1] * (llm.max_model_len + 1)], GREEDY)
    assert not llm.has_unfinished()


def test_bad_sampling_params_are_refused():
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_memory_estimate_matches_the_loaded_engine(llm, demo_gguf):
    from engine.memory import device_memory, estimate_memory

    est = estimate_memory(demo_gguf, dtype="float32", context_tokens=llm.kv_cache_tokens,
                          concurrency=1)
    assert est.parameters == 134_515_008
    assert est.weight_bytes == llm.weight_bytes
    assert est.kv_bytes == llm.kv_cache_bytes
    cpu = device_memory()[0]
    assert cpu.kind == "cpu" and 0 < cpu.free_bytes <= cpu.total_bytes


def test_load_reports_progress_and_can_be_cancelled(demo_gguf):
    from engine import LoadCancelled

    seen: list[float] = []

    def cancel_half_way(fraction: float) -> None:
        seen.append(fraction)
        if fraction > 0.5:
            raise LoadCancelled("cancelled by the test")

    with pytest.raises(LoadCancelled):
        LLM(str(demo_gguf), device="cpu", dtype="float32", progress=cancel_half_way)
    assert seen == sorted(seen) and 0.5 < seen[-1] < 0.6


def test_stale_values_in_the_kv_pool_never_reach_the_output(llm, alone):
    # Blocks are reused without clearing; padded attention rows must not read them (a NaN
    # times a zero attention weight is still NaN).
    llm.runner.kv[:, :, : llm.runner.null_slot].fill_(float("nan"))
    together = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in together] == alone


def test_prefix_cache_reuses_shared_blocks_and_keeps_outputs(demo_gguf, llm):
    system = "You are a helpful assistant for a bike shop in a small town by the sea. " * 6
    prompts = [system + q for q in ("What bikes do you sell?", "Do you repair tires?",
                                    "When are you open on Sundays?")]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    cached = LLM(str(demo_gguf), device="cpu", dtype="float32",
                 kv_cache_tokens=2048, prefix_caching=True)
    first = cached.generate([prompts[0]], GREEDY)[0]
    rid = cached.add_request(prompts[1], GREEDY)
    _, stats = cached.step()
    shared = len(cached.tokenizer.encode(system)) // 16 * 16
    assert stats.prefix_cache_hits >= shared - 16 > 0
    assert stats.num_prefill_tokens == stats.prefix_cache_queries - stats.prefix_cache_hits
    outs = {}
    while cached.has_unfinished():
        outputs, _ = cached.step()
        outs.update((o.request_id, o) for o in outputs if o.finished)
    assert first.token_ids == expected[0] and outs[rid].token_ids == expected[1]
    assert [o.token_ids for o in cached.generate(prompts, GREEDY)] == expected
    c = cached.prefix_cache.counters
    assert 0 < c.hits < c.queries and c.hit_rate > 0.5
    assert cached.block_manager.num_used_blocks == 0  # cached blocks are free to evict


def test_prefix_cache_evicts_when_memory_is_needed(demo_gguf):
    small = LLM(str(demo_gguf), device="cpu", dtype="float32",
                kv_cache_tokens=256, prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(6):  # distinct 100-token prompts: the cache must give blocks back
        small.generate([[100 + i] * 100], params)
    bm = small.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert len(bm.hash_to_block) <= bm.num_blocks
