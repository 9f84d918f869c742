"""From chosen tokens to what a client reads: detokenizing, finish reasons, stop strings and
stream deltas (vLLM v1's output processor, in the engine's own process)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.detokenizer import append_token_text, final_text
from engine.grammar import new_matcher
from engine.logprobs import token_logprobs
from engine.sequence import Sequence, StreamDelta

Finish = Callable[[Sequence, str, float], None]


class OutputProcessor:
    """Appends a step's tokens to their sequences and decides when each one ends."""

    def __init__(self, tokenizer, max_model_len: int, finish: Finish) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self._finish = finish  # the core's: takes the sequence out of the scheduler's queues

    def add(self, seq: Sequence) -> None:
        """A new request: the grammar matcher its tokens will advance, if it asked for one."""
        if seq.params.grammar is not None:
            seq.grammar = new_matcher(seq.params.grammar, self.tokenizer)

    def append(self, seq: Sequence, tokens: list[int], now: float,
               logits: torch.Tensor | None = None) -> int:
        """Append tokens in order until one ends the sequence; how many were appended.
        `logits` ([len(tokens), V], the rows the tokens were chosen from) give their
        log-probabilities when the request asked for them."""
        scored = None
        if seq.logprobs is not None and logits is not None:
            scored = token_logprobs(logits, tokens, seq.params.logprobs)
        drafted_from = len(seq.text)  # all but the last token are accepted drafts
        for count, token in enumerate(tokens, start=1):
            if scored is not None:
                seq.logprobs.append(scored[count - 1])
            self._append_token(seq, token, now)
            if count == len(tokens) - 1 and len(seq.text) > drafted_from:
                seq.drafted_spans.append((drafted_from, len(seq.text)))
            if seq.is_finished:
                return count
        return len(tokens)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        m = seq.metrics
        m.token_times.append(now)
        if m.first_token is None:
            m.first_token = now
        reason = self._finish_reason(seq, token)
        if reason is not None:
            seq.text = final_text(self.tokenizer, seq)
            seq.text, stopped = truncate_at_stop(seq.text, seq.params.stop)
            self._finish(seq, "stop" if stopped else reason, now)
            return
        append_token_text(self.tokenizer, seq)
        seq.text, stopped = truncate_at_stop(seq.text, seq.params.stop)
        if stopped:
            self._finish(seq, "stop", now)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "stop"
        if seq.kv is not None and seq.kv.policy.repositions:
            too_long = seq.kv_len >= self.max_model_len  # positions are cache indices
        else:
            too_long = seq.num_tokens >= self.max_model_len
        if len(seq.output_token_ids) >= seq.params.max_tokens or too_long:
            return "length"
        return None


def truncate_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def delta(seq: Sequence) -> StreamDelta:
    """Text and tokens not yet streamed; text that may start a stop string is held back."""
    hold = 0 if seq.is_finished else max((len(s) - 1 for s in seq.params.stop), default=0)
    visible = max(seq.emitted_text_len, len(seq.text) - hold)
    out = StreamDelta(seq.request_id, seq.text[seq.emitted_text_len : visible],
                      seq.output_token_ids[seq.emitted_token_len :],
                      drafted=_spans_within(seq.drafted_spans, seq.emitted_text_len, visible))
    if seq.logprobs is not None:
        out.logprobs = seq.logprobs[seq.emitted_token_len :]
    seq.emitted_text_len = visible
    seq.emitted_token_len = len(seq.output_token_ids)
    if seq.is_finished:
        out.finish_reason = seq.finish_reason
        out.output = seq.to_output()
    return out


def _spans_within(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of the spans inside text[start:end], as offsets from start (newest last, so
    only the tail of the list is looked at)."""
    out = []
    for a, b in reversed(spans):
        if b <= start:
            break
        if a < end:
            out.append((max(a, start) - start, min(b, end) - start))
    return out[::-1]
