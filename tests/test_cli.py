"""The command line as a user runs it: JSON on stdout, progress on stderr, clear errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest

from engine.cpu_features import cpu_default_dtype


def servescope(*args: str, tmp_path=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if tmp_path is not None:
        env["SERVESCOPE_DATA_DIR"] = str(tmp_path)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_generate_json(demo_gguf):
    r = servescope("generate", "--model", str(demo_gguf), "--prompt", "The capital of France is",
                   "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"].startswith(" Paris")
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0 and out["tokens_per_s"] > 0
    assert "loaded" in r.stderr


def test_generate_by_name_with_chat_template(demo_gguf):
    r = servescope("generate", "--model", "smollm2-135m-instruct", "--chat", "--prompt",
                   "What is the capital of France? Answer in one word.", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"


def test_models_list_json_shows_the_demo(demo_gguf):
    r = servescope("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    models = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    demo = models["smollm2-135m-instruct"]
    assert demo["format"] == "gguf" and demo["architecture"] == "llama"
    assert demo["size_bytes"] == demo_gguf.stat().st_size


@pytest.mark.parametrize("model,needle", [
    ("/no/such/model.gguf", "does not exist"),
    ("no-such-model", "not found"),
])
def test_bad_model_is_one_clear_error(model, needle, tmp_path):
    r = servescope("generate", "--model", model, "--prompt", "hi", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]
    assert needle in r.stderr.lower() and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_corrupt_gguf_is_one_clear_error(demo_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(demo_gguf.read_bytes()[: 5_000_000])
    r = servescope("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cut.gguf" in r.stderr


def test_bench_quick_json(demo_gguf, tmp_path):
    r = servescope("bench", "--model", str(demo_gguf), "--quick", "--json", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert set(out["throughput_tokens_per_s"]) == {"1", "4"}
    assert out["machine"]["cpus"] >= 1
    assert (out["weights"], out["kv_cache_dtype"]) == ("float", "auto")
    # "auto" is bfloat16 on a CPU with bfloat16 instructions or AVX2 (the tile kernels), which
    # the planner models; float32 elsewhere, which it does not, so such a run calibrates nothing.
    expected = "bf16" if cpu_default_dtype() == "bfloat16" else None
    assert out["dtype"] == cpu_default_dtype()
    assert out["precision"] == {"weights": expected, "kv": expected}
    saved = (tmp_path / "bench_results.jsonl").read_text().splitlines()
    assert json.loads(saved[-1])["ttft_ms"] == out["ttft_ms"]


def _default_sigint() -> None:
    """In the server's process: Ctrl+C's default action. A shell starts background jobs with
    SIGINT ignored, and a child inherits that, so a test suite run in the background would
    otherwise send a SIGINT the server never sees."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def serving(model, *flags: str):
    """`servescope serve --model MODEL --port 0 FLAGS` in a process of its own: yields the URL
    it says it listens at, then stops it with Ctrl+C (SIGINT) and checks it exits cleanly."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", str(model),
                             "--port", "0", *flags],
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        url = None
        for line in proc.stderr:
            match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            if match:
                url = match.group(1)
                break
        assert url, "the server never said where it listens"
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) in (0, 130)  # generous: CI machines are shared


def test_serve_answers_over_http_and_stops_on_sigint(demo_gguf):
    import httpx

    with serving(demo_gguf, "--kv-cache-tokens", "1024") as url:
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 3,
                             "temperature": 0})
        assert r.json()["choices"][0]["text"].startswith(" Paris")
        assert "vllm:time_to_first_token_seconds_count" in httpx.get(f"{url}/metrics").text


def test_serve_beyond_loopback_needs_a_key_or_an_explicit_flag():
    r = servescope("serve", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    assert "without an API key" in r.stderr and "--allow-unauthenticated-remote" in r.stderr
    assert "Traceback" not in r.stderr


KV_PROMPT = "The history of the Roman Empire spans many centuries, beginning with"


def test_generate_with_kv_eviction_reports_it(demo_gguf):
    r = servescope("generate", "--model", str(demo_gguf), "--prompt", KV_PROMPT,
                   "--max-tokens", "40", "--kv-policy", "h2o", "--kv-budget", "32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kv_policy"] == "h2o" and out["kv_budget"] == 32  # "32" is read as tokens
    assert out["generated_tokens"] == 40 and out["text"].strip()
    # 12 prompt + 40 new tokens under a 32-token budget: the rest was evicted.
    assert out["kv_tokens_evicted"] > 0
    assert out["prefix_caching"] is False and out["prefix_cache_hit_rate"] is None


@pytest.mark.parametrize("flags,needle", [
    (["--kv-policy", "lru", "--kv-budget", "32"], "Unknown KV eviction policy 'lru'"),
    (["--kv-policy", "h2o", "--kv-budget", "lots"], "kv_budget must be a number"),
])
def test_bad_kv_flags_are_one_clear_error(demo_gguf, flags, needle):
    r = servescope("generate", "--model", str(demo_gguf), "--prompt", "hi", *flags, "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert needle in json.loads(r.stdout)["error"]
    assert len(r.stderr.strip().splitlines()) == 1


def test_bench_reports_kv_options(demo_gguf, tmp_path):
    r = servescope("bench", "--model", str(demo_gguf), "--quick", "--json", "--kv-policy",
                   "streaming", "--kv-budget", "64", "--prefix-caching", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kv_policy"] == "streaming" and out["kv_budget"] == 64
    # The quick benchmark's requests (at most 48 tokens) stay within 64 tokens plus the block
    # of slack compaction waits for, so nothing is evicted; test_generate_... shows evictions.
    assert out["kv_tokens_evicted"] == 0 and out["prefix_caching"] is True
    assert 0 <= out["prefix_cache_hit_rate"] <= 1
    assert out["decode_tokens_per_s"] > 0


def test_serve_with_kv_policy_counts_evictions_on_metrics(demo_gguf):
    import httpx

    with serving(demo_gguf, "--kv-cache-tokens", "1024", "--kv-policy", "scissorhands",
                 "--kv-budget", "32") as url:
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": KV_PROMPT, "max_tokens": 40, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 40
        metrics = httpx.get(f"{url}/metrics").text
        counted = re.search(r"^servescope:kv_evicted_tokens_total\{[^}]*\} (\S+)$", metrics,
                            re.MULTILINE)
        assert counted and float(counted.group(1)) > 0


def test_plan_evaluate_and_search_are_wired_in():
    r = servescope("plan", "evaluate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
                   "--input-len", "512", "--output-len", "128", "--rate", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fits"] and out["ttft_ms"]["p99"] >= out["ttft_ms"]["p50"] > 0
    assert out["cost_per_hour"] > 0 and out["throughput_tok_s"] > 0
    r = servescope("plan", "search", "--model", "llama-3.1-8b", "--rate", "5", "--input-len",
                   "512", "--output-len", "128", "--ttft-p99-ms", "2000", "--tpot-p99-ms", "100",
                   "--json")
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["evaluated"] > 100 and found["candidates"]
    # Every plan carries the commands that run it, not only the best one: each names its own
    # tensor-parallel size (as the plan says it) and the model.
    plans = found["candidates"] + found["pareto"]
    assert len({p["vllm_command"] for p in plans}) > 1
    for plan in plans:
        assert f"--tensor-parallel-size {plan['tp']} " in plan["vllm_command"]
        assert f"--max-num-seqs {plan['max_seqs']} " in plan["vllm_command"]
        assert "Llama-3.1-8B" in plan["vllm_command"]
        if plan["sglang_command"] is not None:  # None: SGLang cannot run this plan
            assert f"--tp-size {plan['tp']} " in plan["sglang_command"]


def test_bad_weights_is_one_clear_error(demo_gguf):
    r = servescope("generate", "--model", str(demo_gguf), "--weights", "int3", "--prompt", "hi",
                   "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Unknown weights format 'int3'" in json.loads(r.stdout)["error"]
    assert len(r.stderr.strip().splitlines()) == 1
