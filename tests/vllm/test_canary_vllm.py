"""The quality canary against real vLLM: `servescope record --canary` scores the bundled held-out
text through vLLM's prompt log-probabilities and stores the perplexity, which agrees with
servescope's own engine on the same weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from monitor.canary import heldout_text, score
from monitor.cli import main
from storage import queries
from storage.db import open_database


def test_the_canary_reads_vllms_prompt_logprobs_and_stores_them(vllm_server, demo_gguf,
                                                                  tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'canary.db'}"
    code = main(["record", "--db", url, "--canary",
                 f"vllm={vllm_server.url},model={vllm_server.model},every=1",
                 "--duration", "50", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    # (One score of 465 prompt tokens took 16-22 s on vLLM's CPU path on a 2-core machine
    # without AVX512-BF16: the recording runs long enough for one to land.)
    assert code == 0 and out["sources"] == {"vllm": "up"}, (json.dumps(out), captured.err[-2000:])
    db = open_database(url)
    try:
        _, stored = queries.series_window(db, "vllm/canary_perplexity", 0, 2e10, "raw")
        _, tokens = queries.series_window(db, "vllm/canary_tokens", 0, 2e10, "raw")
    finally:
        db.close()
    assert len(stored) >= 1 and all(math.isfinite(p) for p in stored)

    # The same text scored by hand on vLLM, and by servescope's engine on the demo GGUF (the
    # weights vLLM's folder was converted from), in float32: the same model's perplexity,
    # within what vLLM's bfloat16 changes.
    direct = score(vllm_server.url, vllm_server.model, heldout_text())
    assert stored[-1] == pytest.approx(direct.perplexity, rel=1e-3)
    from engine import LLM

    llm = LLM(str(demo_gguf), device="cpu", dtype="float32", max_model_len=1024)
    try:
        ids = llm.tokenizer.encode(heldout_text())
        logp = torch.log_softmax(llm.prompt_logits(ids), dim=-1)
    finally:
        llm.close()
    ours = math.exp(-sum(float(logp[i - 1, t]) for i, t in enumerate(ids) if i) / (len(ids) - 1))
    assert int(tokens[-1]) == len(ids) - 1 == direct.tokens
    assert direct.perplexity == pytest.approx(ours, rel=0.03)
