"""OpenAI response objects for one request: completion or chat, whole or as stream chunks, with
log-probabilities in each API's own shape (chat: `logprobs.content[]`; completions: `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), vLLM's `prompt_logprobs`, and a chat reply's
tool calls (`message.tool_calls`, streamed as `delta.tool_calls`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.sequence import StreamDelta
from engine.tool_calls import Content, ToolCall, ToolPlan

# OpenAI's stand-in for a log-probability of -inf, which JSON cannot carry.
MIN_LOGPROB = -9999.0


@dataclass
class ReplyOptions:
    """What a request asked to see beyond the text."""

    logprobs: int | None = None  # top alternatives per token (None: no logprobs at all)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field
    echo: bool = False  # completions: the prompt before the reply, its tokens scored too
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    prompt_scores: list[TokenLogprob | None] | None = None  # from the engine loop's Admitted
    decoded_from: int | None = None  # prompt scored by decoding from this token on (said back)
    tools: ToolPlan | None = None  # a chat request's tools: the reply is read for calls


class Reply:
    """Builds the response bodies of one request and its n choices (one id and creation time
    for all of them)."""

    def __init__(self, model: str, chat: bool, tokenizer=None,
                 options: ReplyOptions | None = None, n: int = 1) -> None:
        self.model, self.chat, self.tokenizer, self.n = model, chat, tokenizer, n
        self.options = options or ReplyOptions()
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets = [0] * n  # completions' text_offset of each choice's next token
        plan = self.options.tools
        reads_calls = chat and plan is not None and plan.mode != "none"
        self._tools = [_ToolReply(plan) for _ in range(n)] if reads_calls else None

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        said = ({} if self.options.decoded_from is None
                else {"prompt_logprobs_decoded_from": self.options.decoded_from})
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices} | said

    # ---- streaming ----
    def opening(self) -> list[dict]:
        o = self.options
        if self.chat:
            return [self._envelope("chat.completion.chunk", [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]) | self._prompt_field() for i in range(self.n)]
        if not o.echo:
            return []
        return [self._envelope("text_completion", [self._echo_choice(i)])
                for i in range(self.n)]

    def _echo_choice(self, index: int) -> dict:
        choice = {"index": index, "text": self.options.prompt_text,
                  "logprobs": self._echo_logprobs(index), "finish_reason": None}
        if self.options.prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs()
        return choice

    def chunk(self, delta: StreamDelta, index: int = 0) -> dict:
        text, scores = self._visible(delta.text, delta.logprobs)
        if self.chat:
            message, finish = {"content": text}, delta.finish_reason
            if self._tools is not None:
                tools = self._tools[index]
                content, calls = tools.feed(text, final=delta.output is not None)
                # Beside calls, no content is null (as vLLM and OpenAI stream it).
                message = {"content": content or None, "tool_calls": calls} if calls else \
                    {"content": content}
                finish = tools.finish_reason(finish)
            return self._envelope("chat.completion.chunk", [
                {"index": index, "delta": message,
                 "logprobs": self._chat_logprobs(scores), "finish_reason": finish}])
        return self._envelope("text_completion", [
            {"index": index, "text": text,
             "logprobs": self._completion_logprobs(scores, index),
             "finish_reason": delta.finish_reason}])

    def usage_chunk(self, outputs: list) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": self.usage(outputs)}

    # ---- whole ----
    def whole(self, choices: list[list[StreamDelta]]) -> dict:
        """The reply from each choice's deltas (the last of each carries its output)."""
        body = [self._whole_choice(i, deltas) for i, deltas in enumerate(choices)]
        kind = "chat.completion" if self.chat else "text_completion"
        extra = self._prompt_field() if self.chat else {}
        return self._envelope(kind, body) | extra | {
            "usage": self.usage([d[-1].output for d in choices])}

    def _whole_choice(self, index: int, deltas: list[StreamDelta]) -> dict:
        output = deltas[-1].output
        text, scores = self._visible("".join(d.text for d in deltas),
                                     [s for d in deltas for s in (d.logprobs or [])])
        if self.chat:
            message, finish = {"role": "assistant", "content": text}, output.finish_reason
            if self._tools is not None:
                tools = self._tools[index]
                content, _ = tools.feed(text, final=True)
                if tools.calls:  # OpenAI's content is null beside calls unless the model said more
                    message = {"role": "assistant", "content": content if content.strip()
                               else None, "tool_calls": [c.as_openai() for c in tools.calls]}
                else:
                    message["content"] = content
                finish = tools.finish_reason(finish)
            return {"index": index, "message": message, "logprobs": self._chat_logprobs(scores),
                    "finish_reason": finish}
        o = self.options
        choice = self._echo_choice(index) if o.echo else {"index": index, "text": "",
                                                            "logprobs": None}
        if o.prompt_logprobs and not o.echo:  # vLLM puts them on every completion choice
            choice["prompt_logprobs"] = self._prompt_logprobs()
        logprobs = self._completion_logprobs(scores, index)  # after the echo: offsets follow
        choice["text"] += text
        choice["logprobs"] = _join(choice["logprobs"], logprobs)
        choice["finish_reason"] = output.finish_reason
        return choice

    def usage(self, outputs: list) -> dict:
        """The prompt once (all choices share it), the tokens of every choice."""
        prompt = len(outputs[0].prompt_token_ids)
        completion = 0 if self.options.echo_only else sum(len(o.token_ids) for o in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # ---- log-probabilities ----
    def _visible(self, text: str, scores: list | None) -> tuple[str, list | None]:
        """Echo without generation shows nothing of the one token the engine had to make."""
        if self.options.echo_only:
            return "", [] if scores is not None else None
        return text, scores

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, scores: list[TokenLogprob] | None) -> dict | None:
        if self.options.logprobs is None or scores is None:
            return None
        return {"content": [self._chat_entry(s.token_id, s.logprob) | {"top_logprobs": [
            self._chat_entry(t, lp) for t, lp in s.top]} for s in scores]}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        token = self._token(token_id)
        return {"token": token, "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(token.encode("utf-8"))}

    def _completion_logprobs(self, scores: list[TokenLogprob | None] | None,
                             index: int) -> dict | None:
        if self.options.logprobs is None or scores is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for s in scores:
            token = self._token(s.token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self._offsets[index])
            self._offsets[index] += len(token)
            out["token_logprobs"].append(max(s.logprob, MIN_LOGPROB))
            # The chosen token with the top alternatives, as OpenAI's completions do.
            top = {self._token(t): max(lp, MIN_LOGPROB) for t, lp in s.top}
            out["top_logprobs"].append({token: max(s.logprob, MIN_LOGPROB)} | top)
        return out

    def _echo_logprobs(self, index: int) -> dict | None:
        """The prompt's tokens in the completions shape (the first has no log-probability)."""
        o = self.options
        if o.logprobs is None:
            return None
        first = self._token(o.prompt_ids[0])
        out = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None],
               "text_offset": [0]}
        self._offsets[index] = len(first)
        return _join(out, self._completion_logprobs(o.prompt_scores[1:], index))

    def _prompt_logprobs(self) -> list:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else a map from token
        id to its logprob, rank and text, the prompt's own token first."""
        def entry(s: TokenLogprob) -> dict:
            ranked = {s.token_id: (s.logprob, s.rank)}
            for rank, (t, lp) in enumerate(s.top, start=1):
                ranked.setdefault(t, (lp, rank))
            return {str(t): {"logprob": max(lp, MIN_LOGPROB), "rank": r,
                             "decoded_token": self._token(t)} for t, (lp, r) in ranked.items()}

        return [None if s is None else entry(s) for s in self.options.prompt_scores]

    def _prompt_field(self) -> dict:
        return {"prompt_logprobs": self._prompt_logprobs()} if self.options.prompt_logprobs \
            else {}


class _ToolReply:
    """One choice's text read for tool calls as it grows: the content outside the calls, and
    the calls as OpenAI's tool-call deltas (a call whole once read, or a named function's
    arguments piece by piece)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.scanner = plan.scanner()
        self.parallel = plan.parallel
        self.text = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The new content and tool-call deltas once `text` is added."""
        self.text += text
        content, deltas = [], []
        for piece in self.scanner.feed(self.text, final):
            if isinstance(piece, Content):
                content.append(piece.text)
            elif isinstance(piece, ToolCall):
                if self.calls and not self.parallel:
                    continue  # parallel_tool_calls false: the first call only
                deltas.append(piece.as_openai(index=len(self.calls)))
                self.calls.append(piece)
            elif piece.text:  # more of a named function's arguments
                self.calls[piece.index].arguments += piece.text
                deltas.append({"index": piece.index, "function": {"arguments": piece.text}})
        return "".join(content), deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason


def _join(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error object (vLLM answers the same shape)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
