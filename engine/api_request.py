"""From a checked request body (engine/api_schema.py) to what the engine runs: SamplingParams,
what the reply shows (ReplyOptions), and the checks that need the served model (its name,
vocabulary, chat template, context and whether it speculates). Each refusal is a 400 naming
the field and what to do."""

from __future__ import annotations

import json

from engine.api_reply import ReplyOptions
from engine.grammar import GrammarError, GrammarSpec, check
from engine.sequence import RequestError, SamplingParams
from engine.tool_calls import (
    PARSERS,
    ToolPlan,
    ToolServing,
    ToolSetupError,
    call_as_text,
    call_for_template,
    default_tool_prompt,
)


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


# Refused while the server speculates: the fields that change the logits before sampling
# (speculative decoding verifies drafts against the model's own distribution, so they would be
# ignored there), and scoring a prompt by decoding it (every token forced, nothing to verify).
_NOT_WHILE_SPECULATING = ("presence_penalty", "frequency_penalty", "logit_bias",
                          "response_format", "prompt_logprobs_decode_from")


def check_fields(body, chat: bool, llm) -> None:
    """The checks that need the served model; raise ApiError naming the field."""
    if getattr(llm, "spec", None) is not None:
        for name in _NOT_WHILE_SPECULATING:
            value = getattr(body, name, None)
            if value and getattr(value, "type", "json") != "text":
                raise _bad(name, "not available while this server runs speculative "
                                 "decoding: leave it unset, or serve without --speculative")
        if chat and body.tools and _forced(body.tool_choice):
            raise _bad("tool_choice", "forcing a call needs constrained decoding, not "
                                      "available while this server runs speculative decoding: "
                                      "use 'auto' or 'none', or serve without --speculative")
    vocab = llm.config.vocab_size
    bad = next((t for t in (body.logit_bias or {}) if t >= vocab), None)
    if bad is not None:
        raise _bad("logit_bias", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    if not chat and body.best_of not in (None, 1, body.n):
        raise _bad("best_of", "choosing the best of more choices than 'n' is not supported: "
                              "leave it unset or equal to 'n'")
    if chat:
        _check_chat(body)
    elif body.max_tokens == 0 and not body.echo:
        raise _bad("max_tokens", "0 is only meaningful with 'echo': true (score the prompt)")


def check_decode_scoring(body, chat: bool, prompt_len: int) -> int | None:
    """prompt_logprobs_decode_from, checked against the request and the prompt's length
    (check_fields refuses it on a speculating server)."""
    start = body.prompt_logprobs_decode_from
    if start is None:
        return None
    field = "prompt_logprobs_decode_from"
    if logprob_counts(body, chat)[1] is None:
        raise _bad(field, "scores prompt tokens, so ask for them too: 'prompt_logprobs' (or, "
                          "for a completion, 'echo' with 'logprobs')")
    if start >= prompt_len:
        raise _bad(field, f"{start} is not inside the prompt of {prompt_len} tokens: give an "
                          f"index from 1 to {prompt_len - 1}")
    return start


def _check_chat(body) -> None:
    fmt = body.response_format
    if body.ignore_eos and fmt is not None and fmt.type != "text":
        raise _bad("ignore_eos", "cannot be used with a JSON 'response_format': the reply "
                                 "ends where the JSON does")
    if body.top_logprobs and not body.logprobs:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    if _forced(body.tool_choice) and body.tools:
        if body.ignore_eos:
            raise _bad("ignore_eos", "cannot be used with a 'tool_choice' that forces a call: "
                                     "the reply ends where the call does")
        if fmt is not None and fmt.type != "text":
            raise _bad("response_format", "cannot be combined with a 'tool_choice' that forces "
                                          "a call (the call is the reply's format): leave one "
                                          "unset")


def _forced(choice) -> bool:
    """tool_choice "required" or a named function: the reply is constrained to a call."""
    return choice == "required" or isinstance(choice, dict)


# ---- tools ----
def tool_plan(body, serving: ToolServing) -> ToolPlan | None:
    """What the request's tools and tool_choice do on this server's chat template; a 400 naming
    `tools` or `tool_choice` where they cannot work. None: no tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs 'tools' listing the functions to call: give "
                                      "'tools', or leave 'tool_choice' unset or 'none'")
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise _bad("tools", f"the function name {twice!r} is given twice: names must be unique")
    if choice == "none":
        return ToolPlan("none")  # the tools are not shown to the model, as OpenAI's "none"
    parallel = body.parallel_tool_calls is not False
    if choice in (None, "auto"):
        return _auto_plan(tools, serving, parallel)
    name = None if choice == "required" else _named_choice(choice, names)
    mode = "required" if name is None else "named"
    # A template that shows no tools: the model is told them in a system message, and the
    # grammar makes the reply a call all the same.
    prompt = None if serving.renders_tools else default_tool_prompt(tools, mode, name)
    return ToolPlan(mode, tools, function=name, parallel=parallel, prompt=prompt)


def _auto_plan(tools: list[dict], serving: ToolServing, parallel: bool) -> ToolPlan:
    if not serving.renders_tools:
        raise _bad("tools", "this model's chat template has no tool calling, so the model "
                            "cannot choose to call tools ('tool_choice' auto): leave 'tools' "
                            "unset, force a call with 'tool_choice' 'required' or a named "
                            "function, or serve with --chat-template and --tool-call-parser")
    if serving.parser is None:
        raise _bad("tools", "this chat template's tool-call format has no parser here, so "
                            "calls could not be read ('tool_choice' auto): force a call with "
                            "'tool_choice' 'required' or a named function, or serve with "
                            f"--tool-call-parser ({', '.join(PARSERS)})")
    return ToolPlan("auto", tools, parser=serving.parser, parallel=parallel)


def _named_choice(choice: dict, names: list[str]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', "
                                  "'function': {'name': ...}}")
    if name not in names:
        raise _bad("tool_choice", f"names the function {name!r}, which is not in 'tools' "
                                  f"({', '.join(names)})")
    return name


def chat_prompt_ids(body, tokenizer, plan: ToolPlan | None, serving: ToolServing) -> list[int]:
    """The conversation rendered through the chat template (the server's --chat-template if
    given), with the tools offered, then tokenized."""
    messages = _template_messages(body.messages, serving)
    offered = plan is not None and plan.tools is not None
    if offered and plan.prompt is not None:
        messages = _with_system_text(messages, plan.prompt)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True,
        chat_template=serving.template if serving.override else None,
        tools=plan.tools if offered else None)
    return tokenizer.encode(text)


def _template_messages(messages, serving: ToolServing) -> list[dict]:
    """The messages as chat templates read them (HF's form): assistant calls with their
    arguments as objects, tool results with their call's id. A template that cannot render calls
    gets them as JSON in the content, so the model still sees what it called."""
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        calls = [c.model_dump(exclude_none=True) for c in m.tool_calls or []]
        if calls and serving.renders_tool_calls:
            entry["tool_calls"] = [call_for_template(c) for c in calls]
        elif calls:
            entry["content"] = "\n".join([entry["content"]] * bool(entry["content"]) +
                                         [call_as_text(c) for c in calls])
        out.append(entry)
    return out


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0] | {"content": f"{messages[0]['content']}\n\n{text}".lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- constrained decoding ----
def grammar_spec(body, chat: bool, tokenizer, plan: ToolPlan | None = None) -> GrammarSpec | None:
    """The grammar a response_format or a forced tool call asks for, compiled once here to
    refuse a bad schema (on a worker thread: a large schema takes a while)."""
    if plan is not None and plan.mode in ("named", "required"):
        try:
            schema = plan.schema()
        except ToolSetupError as exc:
            raise _bad("tools", str(exc)) from None
        return _checked(GrammarSpec("json_schema", json.dumps(schema)), tokenizer, "tools")
    fmt = getattr(body, "response_format", None) if chat else None
    if fmt is None or fmt.type == "text":
        return None
    schema = json.dumps(fmt.json_schema.json_schema) if fmt.type == "json_schema" else ""
    return _checked(GrammarSpec(fmt.type, schema), tokenizer, "response_format")


def _checked(spec: GrammarSpec, tokenizer, field: str) -> GrammarSpec:
    try:
        check(spec, tokenizer)
    except GrammarError as exc:
        what = str(exc).replace("the schema", "a function's 'parameters' schema", 1) \
            if field == "tools" else str(exc)
        raise _bad(field, what) from None
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
