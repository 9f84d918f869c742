"""The demo draft's training corpus (benchmarks/train_draft.py): the states it records while the
engine generates are the target's own, at the positions that chose each token."""

from __future__ import annotations

import json

import torch

from benchmarks.train_draft import examples, generate, record, rows_of, target_states
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
