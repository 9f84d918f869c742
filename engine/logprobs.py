"""Log-probabilities a request asks for: of each chosen token with its most likely alternatives
(OpenAI's logprobs / top_logprobs), and of every prompt token (vLLM's prompt_logprobs, echo).

They are the model's own distribution, log_softmax of the raw logits, before temperature,
penalties, logit_bias or a grammar mask change it (vLLM's default "raw_logprobs"): a client
scoring a text gets the model's probabilities, not those of one request's sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank, and the k most likely."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each row of `logits` ([R, V]) scored at its token, with the k most likely tokens."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    ids = torch.tensor(tokens, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, ids)
    ranks = (lp > chosen).sum(dim=1) + 1
    if k > 0:
        top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True))
                for i, v in zip(top_ids.tolist(), top_lp.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp_, r, top) for t, lp_, r, top in
            zip(tokens, chosen.squeeze(1).tolist(), ranks.tolist(), tops, strict=True)]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int],
                    k: int) -> list[TokenLogprob | None]:
    """Every prompt token's log-probability given the tokens before it, from the logits of
    each prompt position ([len, V]: position i predicts token i + 1). The first token has no
    context, so None, as vLLM answers."""
    return [None, *token_logprobs(logits[:-1], prompt_ids[1:], k)]
