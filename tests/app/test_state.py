"""The Engine pane's plain-Python state: chat history, figures, buffers, memory verdicts."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from app.panes.engine.state import (
    ChatSession,
    LoadRequest,
    RateMeter,
    ReplyFigures,
    SamplingSettings,
    StreamBuffer,
    format_bytes,
    memory_verdict,
)


def test_chat_session_builds_requests_without_the_open_reply() -> None:
    session = ChatSession()
    session.ask("Hi")
    assert session.request_messages("Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    session.append("Hello")
    session.append(" there")
    session.finish(None)
    assert session.last_reply() == "Hello there"
    assert session.regenerate()
    assert session.request_messages("") == [{"role": "user", "content": "Hi"}]
    with pytest.raises(RuntimeError):
        session.ask("again")


def test_failed_reply_is_left_out_of_the_next_request() -> None:
    session = ChatSession()
    session.ask("one")
    session.append("partial")
    session.finish(None, error="boom")
    assert session.request_messages("") == [{"role": "user", "content": "one"}]
    session.clear()
    assert session.turns == []


def test_reply_figures_read_the_engine_metrics() -> None:
    metrics = SimpleNamespace(ttft_s=0.085, prefill_tokens_per_s=412.0, decode_tokens_per_s=35.5,
                              prompt_tokens=21, generated_tokens=40)
    figures = ReplyFigures.from_output(SimpleNamespace(metrics=metrics, finish_reason="abort"))
    assert figures.summary() == ("TTFT 85 ms · prefill 412 tok/s · decode 36 tok/s · "
                                 "21 prompt + 40 generated tokens · stopped")


def test_stream_buffer_hands_over_everything_once() -> None:
    buffer = StreamBuffer()
    threads = [threading.Thread(target=lambda: [buffer.push("ab") for _ in range(500)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert buffer.drain() == "ab" * 2000
    assert buffer.drain() == ""


def test_rate_meter_counts_a_sliding_window() -> None:
    meter = RateMeter(window_s=2.0)
    meter.add(10, now=100.0)
    meter.add(30, now=101.0)
    assert meter.rate(now=101.5) == 20.0
    assert meter.rate(now=102.5) == 15.0
    assert meter.rate(now=110.0) == 0.0


def test_memory_verdicts() -> None:
    gib = 1 << 30
    assert memory_verdict(gib, "the CPU", 8 * gib, 4 * gib)[0] == "ok"
    level, text = memory_verdict(6 * gib, "the CPU", 8 * gib, 4 * gib)
    assert level == "warning" and "4.0 GiB free" in text
    level, text = memory_verdict(9 * gib, "GPU 0 (H200)", 8 * gib, 8 * gib)
    assert level == "error" and "lower the context" in text
    assert format_bytes(1536) == "1.5 KiB"


def test_requests_are_validated_and_map_to_engine_arguments() -> None:
    from engine.engine_config import EngineConfig

    request = LoadRequest("m.gguf", "cpu", "auto", 1024, 2)
    assert request.engine_config() == EngineConfig("m.gguf", device="cpu", max_model_len=1024,
                                                   kv_cache_tokens=2048)
    assert LoadRequest("m.gguf", weights="int4").engine_config().weights == "int4:g32"
    assert LoadRequest("m.gguf", kv_cache_dtype="int8").engine_config().kv_cache_dtype == "int8"
    assert LoadRequest("m.gguf", speculative="ngram:k=10").engine_config().speculative == \
        "ngram:k=10"
    assert LoadRequest("m.gguf", speculative="off").engine_config().speculative is None
    for bad in ({"model": ""}, {"model": "m.gguf", "weights": "int3"},
                {"model": "m.gguf", "context_tokens": 8},
                {"model": "m.gguf", "kv_policy": "h2o"}):  # a policy without a budget
        with pytest.raises(ValueError):
            LoadRequest(**bad)
    assert SamplingSettings(seed=-1).as_kwargs()["seed"] is None
    assert SamplingSettings(seed=7, top_k=0).as_kwargs()["seed"] == 7


def test_drafted_spans_keep_their_place_through_the_buffer_and_the_session() -> None:
    buffer = StreamBuffer()
    buffer.push("Hello", [(0, 3)])
    buffer.push(" world", [(1, 4)])
    text, drafted = buffer.drain_marked()
    assert text == "Hello world" and [text[a:b] for a, b in drafted] == ["Hel", "wor"]
    session = ChatSession()
    session.ask("Hi")
    session.append("Oh, ", [])
    session.append(text, drafted)
    turn = session.turns[-1]
    assert [turn.content[a:b] for a, b in turn.drafted] == ["Hel", "wor"]
    assert buffer.drain_marked() == ("", [])
