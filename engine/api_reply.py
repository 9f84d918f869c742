"""OpenAI response objects for one request: completion or chat, whole or as stream chunks."""

from __future__ import annotations

import time
import uuid

from engine.sequence import StreamDelta


class Reply:
    """Builds the response bodies of one request (one id and creation time for all of them)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def opening(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._envelope("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]

    def chunk(self, delta: StreamDelta) -> dict:
        if self.chat:
            return self._envelope("chat.completion.chunk", [
                {"index": 0, "delta": {"content": delta.text}, "finish_reason":
                 delta.finish_reason}])
        return self._envelope("text_completion", [
            {"index": 0, "text": delta.text, "logprobs": None,
             "finish_reason": delta.finish_reason}])

    def usage_chunk(self, output) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": usage(output)}

    def whole(self, deltas: list[StreamDelta]) -> dict:
        output = deltas[-1].output
        text = "".join(d.text for d in deltas)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": output.finish_reason}
            return self._envelope("chat.completion", [choice]) | {"usage": usage(output)}
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": output.finish_reason}
        return self._envelope("text_completion", [choice]) | {"usage": usage(output)}


def usage(output) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error object (vLLM answers the same shape)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
