"""From a checked request body (engine/api_schema.py) to what the engine runs: SamplingParams,
what the reply shows (ReplyOptions), and the checks that need the served model (its name,
vocabulary, chat template, context and whether it speculates). Each refusal is a 400 naming
the field and what to do."""

from __future__ import annotations

import json

from engine.api_reply import ReplyOptions
from engine.grammar import GrammarError, GrammarSpec, check
from engine.sequence import RequestError, SamplingParams


class ApiError(Exception):
    """An error the client caused (or a 503), sent back as OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def check_model(body, served: str) -> None:
    """vLLM's answer to another model's name: 404, NotFoundError, naming the served one."""
    if body.model is not None and body.model != served:
        raise ApiError(404, f"The model `{body.model}` does not exist. Valid aliases: "
                            f"{served}.", "NotFoundError", param="model")


# Fields that change the logits before sampling; speculative decoding verifies drafts against
# the model's own distribution, so they would be ignored there (refused instead).
_PROCESSING = ("presence_penalty", "frequency_penalty", "logit_bias", "response_format")


def check_fields(body, chat: bool, llm) -> None:
    """The checks that need the served model; raise ApiError naming the field."""
    if getattr(llm, "spec", None) is not None:
        for name in _PROCESSING:
            value = getattr(body, name, None)
            if value and getattr(value, "type", "json") != "text":
                raise _bad(name, "not available while this server runs speculative "
                                 "decoding: leave it unset, or serve without --speculative")
    vocab = llm.config.vocab_size
    bad = next((t for t in (body.logit_bias or {}) if t >= vocab), None)
    if bad is not None:
        raise _bad("logit_bias", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    if not chat and body.best_of not in (None, 1, body.n):
        raise _bad("best_of", "choosing the best of more choices than 'n' is not supported: "
                              "leave it unset or equal to 'n'")
    if chat:
        _check_chat(body, llm)
    elif body.max_tokens == 0 and not body.echo:
        raise _bad("max_tokens", "0 is only meaningful with 'echo': true (score the prompt)")


def _check_chat(body, llm) -> None:
    fmt = body.response_format
    if body.ignore_eos and fmt is not None and fmt.type != "text":
        raise _bad("ignore_eos", "cannot be used with a JSON 'response_format': the reply "
                                 "ends where the JSON does")
    if body.top_logprobs and not body.logprobs:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    if body.tools:
        raise _bad("tools", "this model's chat template has no tool calling, so the model "
                            "cannot call tools: leave 'tools' unset"
                   if "tools" not in llm.tokenizer.chat_template else
                   "tool-call parsing is not implemented for this model family: leave "
                   "'tools' unset")
    if body.tool_choice not in (None, "none"):
        raise _bad("tool_choice", "needs 'tools', which this model cannot use: leave it "
                                  "unset or 'none'")


def grammar_spec(body, chat: bool, tokenizer) -> GrammarSpec | None:
    """The grammar a response_format asks for, compiled once here to refuse a bad schema
    (on a worker thread: a large schema takes a while)."""
    fmt = getattr(body, "response_format", None) if chat else None
    if fmt is None or fmt.type == "text":
        return None
    schema = json.dumps(fmt.json_schema.json_schema) if fmt.type == "json_schema" else ""
    spec = GrammarSpec(fmt.type, schema)
    try:
        check(spec, tokenizer)
    except GrammarError as exc:
        raise _bad("response_format", str(exc)) from None
    return spec


def logprob_counts(body, chat: bool) -> tuple[int | None, int | None]:
    """Top alternatives per generated token and per prompt token (None: not asked)."""
    if chat:
        generated = (body.top_logprobs or 0) if body.logprobs else None
        return generated, body.prompt_logprobs
    prompt = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt is scored too
        prompt = max(prompt or 0, body.logprobs)
    return body.logprobs, prompt


def reply_options(body, chat: bool, prompt_ids: list[int], tokenizer) -> ReplyOptions:
    generated, _ = logprob_counts(body, chat)
    echo = not chat and body.echo
    return ReplyOptions(
        logprobs=generated, prompt_logprobs=body.prompt_logprobs is not None, echo=echo,
        echo_only=echo and body.max_tokens == 0, prompt_ids=prompt_ids,
        prompt_text=tokenizer.decode(prompt_ids, skip_special_tokens=False) if echo else "")


def sampling_params(body, asked: int, grammar: GrammarSpec | None,
                    chat: bool) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    generated, _ = logprob_counts(body, chat)
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k, max_tokens=asked, seed=body.seed, stop=body.stop_strings(),
            ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=tuple((body.logit_bias or {}).items()), logprobs=generated,
            grammar=grammar, kv_policy=body.kv_policy, kv_budget=body.kv_budget)
    except RequestError as exc:
        raise ApiError(400, f"Bad sampling parameters: {exc}") from exc


def _bad(field: str, what: str) -> ApiError:
    return ApiError(400, f"'{field}': {what}.", param=field)
