"""EngineConfig: the one definition of the engine's options, its CLI flags and derived figures.

Checked from outside: the command line as a user types it, and the real engine on the demo
model agreeing with the figures the config derives (the KV pool a sized load asks for is the
one the engine's admission checks need, and the memory estimate is what the engine allocates).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.cli import _parser, main
from engine.engine_config import EngineConfig


def test_every_option_is_a_flag_of_every_engine_command():
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    for command in ("generate", "bench", "serve"):
        extra = ["--prompt", "x"] if command == "generate" else []
        args = _parser().parse_args([command, *extra])
        assert EngineConfig.from_cli(args) == EngineConfig("smollm2-135m-instruct")
        assert all(hasattr(args, name) for name in fields)


def test_flags_build_the_config_they_say():
    args = _parser().parse_args([
        "serve", "--model", "m.gguf", "--weights", "INT4", "--dtype", "bfloat16",
        "--kv-policy", "heavy-hitter", "--kv-budget", "0.25", "--max-num-seqs", "8",
        "--spec", "ngram:k=3", "--compile", "--kv-cache-tokens", "4096"])
    config = EngineConfig.from_cli(args)
    assert (config.weights, config.dtype, config.kv_policy, config.kv_budget) == \
        ("int4:g32", "bfloat16", "h2o", 0.25)
    assert (config.max_num_seqs, config.speculative, config.torch_compile,
            config.kv_cache_tokens, config.num_draft_tokens) == (8, "ngram:k=3", True, 4096, 3)


@pytest.mark.parametrize("flags, named", [
    (["--weights", "int3"], "weights"),
    (["--dtype", "float64"], "dtype"),
    (["--kv-policy", "lru"], "eviction policy"),
    (["--kv-policy", "h2o"], "kv_budget"),
    (["--kv-policy", "h2o", "--kv-budget", "1.5"], "kv_budget"),
    (["--kv-budget", "lots", "--kv-policy", "h2o"], "kv_budget"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--block-size", "24"], "block_size"),
    (["--spec", "medusa"], "medusa"),
    (["--kv-cache-dtype", "int2"], "KV cache dtype"),
])
def test_a_bad_option_is_one_sentence_before_anything_loads(flags, named, capsys):
    # A model path that does not exist: the option must be refused before the model is read.
    code = main(["generate", "--prompt", "x", "--model", "/nonexistent.gguf", "--json", *flags])
    out, err = capsys.readouterr()
    assert code == 2
    message = json.loads(out)["error"]
    assert named in message and "nonexistent" not in message
    assert err.strip().startswith("servescope:") and "Traceback" not in err


def test_a_sized_load_gets_exactly_the_pool_the_engines_admission_needs(demo_gguf):
    from engine import LLM, SamplingParams
    from engine.sequence import RequestError

    sized = EngineConfig.sized_for(str(demo_gguf), 512, 1, device="cpu", kv_policy="h2o",
                                   kv_budget=64)
    # Budget + a block of slack + the smaller prefill chunk a budgeted load uses.
    assert (sized.kv_cache_tokens, sized.max_num_batched_tokens) == (64 + 16 + 256, 256)
    long = SamplingParams(max_tokens=12)
    prompt = list(range(100, 600))  # 500 prompt tokens + 12 new = the whole context
    llm = LLM(sized)
    try:
        llm.add_request(prompt, long)  # fits: the engine's own peak is the config's
    finally:
        llm.close()
    short = LLM(sized, kv_cache_tokens=sized.kv_cache_tokens - sized.block_size)
    try:
        with pytest.raises(RequestError, match="KV pool holds 320"):
            short.add_request(prompt, long)
    finally:
        short.close()


def test_the_memory_estimate_is_what_the_engine_allocates(demo_gguf):
    from engine import LLM

    # A streaming budget of 10%: each request peaks at 103 + 16 + 256 = 375 tokens, which is
    # 24 whole blocks; the pool holds three of them.
    sized = EngineConfig.sized_for(str(demo_gguf), 1024, 3, device="cpu", kv_cache_dtype="int8",
                                   kv_policy="streaming", kv_budget=0.1)
    assert sized.peak_kv_tokens(1024) == 375 and sized.kv_cache_tokens == 3 * 24 * 16
    estimate = sized.memory_estimate(1024, 3, "cpu")
    llm = LLM(sized)
    try:
        assert estimate.kv_bytes == llm.kv_cache_bytes
        assert estimate.kv_bytes_per_token == llm.kv_bytes_per_token
        assert llm.engine_config == sized and llm.kv_cache_dtype == "int8"
    finally:
        llm.close()


def test_the_engine_and_the_planner_name_precisions_alike():
    from planner.catalog import KV_PRECISIONS, PRECISIONS
    from planner.measured import engine_precisions

    # The planner's names are engine options too, and come back as themselves.
    assert EngineConfig("m", dtype="bf16", weights="int4").precisions("cuda") == ("int4", "bf16")
    assert EngineConfig("m", dtype="fp16", kv_cache_dtype="fp8").precisions("cuda") == \
        ("fp16", "fp8")
    # What a benchmark records and what the planner reads from an older record agree, for every
    # combination the engine runs.
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        for weights in ("float", "int8", "int8:g64", "int4", "int4:g128"):
            for kv in ("auto", "int8", "fp8"):
                config = EngineConfig("m", dtype=dtype, weights=weights, kv_cache_dtype=kv)
                recorded = {"dtype": config.concrete_dtype("cuda"), "weights": config.weights,
                            "kv_cache_dtype": kv}
                assert config.precisions("cuda") == engine_precisions(recorded), recorded
                w, k = config.precisions("cuda")
                assert w is None or w in PRECISIONS
                assert k is None or k in KV_PRECISIONS
