"""Teacher forcing, an evaluation feature (engine/kv_eval.py): a request given the tokens to
append instead of sampled ones, recording the model's log-probability and top-1 choice at each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.features import Step, StepFeature
from engine.logprobs import TokenLogprob, token_logprobs


@dataclass
class ForcedTokens:
    """A teacher-forced request's tokens and what the model thought of each."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    # With top_k set (a server scoring a prompt by decoding it), each position also as the
    # reply's log-probability entry: the token's rank and its top_k most likely alternatives.
    top_k: int | None = None
    scored: list[TokenLogprob] = field(default_factory=list)


class TeacherForcing(StepFeature):
    """Chooses the given next token for every forced request the step samples."""

    def choose(self, step: Step, logits: torch.Tensor, rows: list[int],
               chosen: list[list[int] | None]) -> None:
        for i, s in enumerate(step.sampling):
            forced: ForcedTokens | None = s.seq.forced
            if forced is None or s.num_draft:
                continue
            token = forced.tokens[len(s.seq.output_token_ids)]
            logprobs = torch.log_softmax(logits[rows[i]].float(), dim=-1)
            forced.logprobs.append(float(logprobs[token]))
            forced.top1.append(int(logprobs.argmax()))
            if forced.top_k is not None:
                row = rows[i]
                forced.scored += token_logprobs(logits[row : row + 1], [token], forced.top_k)
            chosen[i] = [token]
