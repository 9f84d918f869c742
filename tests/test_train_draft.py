"""The demo draft's training corpus (benchmarks/train_draft.py): the states it records while the
engine generates are the target's own, at the positions that chose each token."""

from __future__ import annotations

import json

import torch

from benchmarks.train_draft import (
    examples,
    generate,
    record,
    record_streams,
    rows_of,
    target_states,
    target_streams,
)
from engine import LLM

PROMPTS = ["Write a short poem about the ocean.", "Explain what a GPU does in simple terms."]


def _greedy_through_head(llm: LLM, states: torch.Tensor) -> torch.Tensor:
    """The engine's own greedy choice from each recorded state (its head, its dtype)."""
    with torch.inference_mode():
        return llm.model.logits(states.to(llm.model.dtype)).argmax(-1)


def _agreement(a: torch.Tensor, b: list[int]) -> float:
    return float((a == torch.tensor(b)).float().mean())


def test_recorded_states_choose_the_replies_and_label_sampled_ones(demo_gguf, tmp_path):
    model = str(demo_gguf)
    greedy = generate(model, PROMPTS, tmp_path / "replies.jsonl")
    sampled = generate(model, PROMPTS, tmp_path / "sampled.jsonl", temperature=0.7)
    llm = LLM(model, device="cpu")
    for replies, path in ((greedy, "replies.jsonl"), (sampled, "sampled.jsonl")):
        states = target_states(replies, tmp_path / path)
        for reply, h in zip(replies, states, strict=True):
            # One state per chosen token: the last prompt position's, then each reply token's
            # but the last.
            assert h.shape == (len(reply["reply"]), llm.config.hidden_size)
            # The head recomputed over all of a reply's states at once may round a near tie
            # the other way than the step did; a state one position off agrees at a few %.
            assert _agreement(_greedy_through_head(llm, h), reply["best"]) >= 0.97
    # Greedy replies are their own labels; sampled ones are labelled with the greedy choice,
    # which they leave somewhere.
    assert all(r["best"] == r["reply"] for r in greedy)
    assert any(r["best"] != r["reply"] for r in sampled)
    # A rerun resumes from what was saved: nothing is generated again.
    lines = (tmp_path / "replies.jsonl").read_text()
    assert generate(model, PROMPTS, tmp_path / "replies.jsonl") == greedy
    assert (tmp_path / "replies.jsonl").read_text() == lines
    assert [json.loads(line) for line in lines.splitlines()] == greedy


def test_recorded_streams_lie_at_the_recorded_states_positions(demo_gguf, tmp_path):
    """record_streams prefills each reply again and keeps the middle layers' streams where
    generate() kept the final states: the stream after the last layer, through the final norm,
    is that position's state (to the served dtype's rounding), and chooses the same tokens."""
    model = str(demo_gguf)
    replies = generate(model, PROMPTS, tmp_path / "replies.jsonl")
    records = [record(r, i) for i, r in enumerate(replies)]
    record_streams(model, records, tmp_path / "replies.jsonl", (10, 30))
    streams = target_streams(records, tmp_path / "replies.jsonl", (10, 30))
    states = target_states(replies, tmp_path / "replies.jsonl")
    llm = LLM(model, device="cpu")
    hidden = llm.config.hidden_size
    for reply, s, h in zip(replies, streams, states, strict=True):
        assert s.shape == (len(reply["reply"]), 2 * hidden) and s.dtype == torch.float16
        last = s[:, hidden:].float()
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + llm.config.rms_norm_eps)
        normed = normed * llm.model.norm.float()
        # Prefill and decoding round differently; a state one position off is far apart.
        cosine = torch.nn.functional.cosine_similarity(normed, h.float(), dim=-1)
        assert float(cosine.min()) > 0.98
        assert _agreement(_greedy_through_head(llm, normed), reply["best"]) >= 0.95
    # A rerun finds them saved and records nothing again.
    saved = sorted(p.stat().st_mtime_ns for p in tmp_path.glob("replies.streams_*"))
    record_streams(model, records, tmp_path / "replies.jsonl", (10, 30))
    assert sorted(p.stat().st_mtime_ns for p in tmp_path.glob("replies.streams_*")) == saved


def test_chained_examples_follow_the_reply():
    """Step j of position q reads the token at q + j - 1 and the state that chose q + j, and is
    labelled with the target's choice there."""
    reply = {"prompt": [1, 2, 3], "reply": [10, 11, 12, 13, 14], "best": [10, 11, 99, 13, 14]}
    h = torch.arange(5, dtype=torch.float16)[:, None].expand(5, 4).contiguous()
    data = examples([record(reply, 0)], [h], [0], rows_of(torch.arange(100), 100), steps=3)
    # Positions q = 3, 4 (5 reply tokens, 3 steps): h0 is the state before each.
    assert data["h0"][:, 0].tolist() == [0, 1]
    assert data["x1"].tolist() == [10, 11] and data["y1"].tolist() == [11, 99]
    assert data["x2"].tolist() == [11, 12] and data["h2"][:, 0].tolist() == [2, 3]
    assert data["x3"].tolist() == [12, 13] and data["y3"].tolist() == [13, 14]
    # The middle layers' streams go with h0, row for row.
    streams = torch.arange(5, dtype=torch.float16)[:, None].expand(5, 8).contiguous() + 100
    data = examples([record(reply, 0)], [h], [0], rows_of(torch.arange(100), 100), steps=3,
                    streams=[streams])
    assert data["a0"][:, 0].tolist() == [100, 101] and data["a0"].shape == (2, 8)
