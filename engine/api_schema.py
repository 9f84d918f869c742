"""The OpenAI-compatible request bodies `servescope serve` accepts, checked before the engine.

Every field a request can carry is typed and bounded here, so a value the engine cannot run
(a seed beyond 64 bits, a top_k of 1e30, a stop list of numbers, a string with a lone
surrogate) is a 400 naming the field at the door, never an error inside an engine step where it
would take other requests with it. The models are also the server's OpenAPI schema, which the
fuzz tests generate requests from. Fields OpenAI defines but the engine does not implement are
accepted at their neutral value and refused otherwise, saying so; unknown fields are ignored, as
vLLM ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed's signed range
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, and OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 1024  # entries in one logit_bias map
MAX_N = 16  # choices per request


def _encodable(text: str) -> str:
    """Strings must be valid Unicode: JSON's \\ud800 escapes decode to lone surrogates, which
    no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate at character {exc.start}: send "
                         "valid Unicode") from None
    return text


def _known_policy(name: str) -> str:
    from engine.kv_eviction import parse_policy

    parse_policy(name)  # a RequestError (a ValueError) names the choices
    return name


def _valid_budget(value):
    """Tokens (int), a fraction in (0, 1] (float), or either as text, as the CLI reads it."""
    from engine.kv_eviction import resolve_budget
    from engine.kv_options import parse_kv_budget

    if isinstance(value, bool):
        raise ValueError("kv_budget must be a number of tokens or a fraction, not a boolean")
    budget = parse_kv_budget(value)
    resolve_budget(budget, 1 << 30, 16)  # the range checks the engine applies
    return budget


def _bias_keys(value: dict[str, float]) -> dict[int, float]:
    """logit_bias keys are token ids written as JSON object keys (so strings)."""
    out = {}
    for key, bias in value.items():
        if not key.strip().isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        out[int(key)] = bias
    return out


def _refused(why: str, allowed: tuple = ()):
    """An OpenAI parameter of a feature this server does not have: unset (or one of the
    `allowed` neutral values) passes, anything else is a 400 naming it, never ignored."""

    def check(value):
        if value is None or any(value == a and type(value) is type(a) for a in allowed):
            return value
        raise ValueError(f"not supported by this server ({why}): leave it unset")

    return AfterValidator(check)


def _text_only(modalities: list[str]) -> list[str]:
    if any(m != "text" for m in modalities):
        raise ValueError("only text output is supported (no audio): leave it unset or "
                         "['text']")
    return modalities


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                      Field(max_length=MAX_LOGIT_BIAS), AfterValidator(_bias_keys)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: Annotated[bool, _refused("usage is sent once, at the end")] = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's top_k,
    ignore_eos and prompt_logprobs, plus servescope's per-request KV eviction)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    prompt_logprobs: LogprobCount | None = None
    # Identifiers for the caller's own bookkeeping and cache routing; they never change a
    # reply, here or at OpenAI (the prefix cache needs no key).
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    kv_policy: Annotated[Text, AfterValidator(_known_policy)] | None = None
    kv_budget: Annotated[int | float | str, AfterValidator(_valid_budget)] | None = None
    # servescope: prompt tokens from this index on scored by decoding them through the
    # request's KV cache (engine/serve_loop.ScoringRun), for a quality canary that must see
    # what KV eviction or quantization costs a long conversation.
    prompt_logprobs_decode_from: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or token ids (or a list holding one of those,
    as OpenAI's batched form with a single entry)."""

    prompt: (Text | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
             | Annotated[list[Text], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=1)])
    # 0 only with echo: the prompt scored, nothing generated (the monitor's quality canary).
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    echo: bool = False
    logprobs: LogprobCount | None = None
    suffix: Annotated[Any, _refused("no fill-in-the-middle", ("",))] = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def prompt_value(self) -> str | list[int]:
        """The single prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a text's token ids in the served model's tokenizer, as clients
    that size prompts in the server's tokens use it (servescope loadtest --input-unit tokens)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


MAX_TOOLS = 128  # tools in a request, and calls in one assistant message
# OpenAI's rule for function names (it answers 400 to others).
FunctionName = Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class FunctionCall(BaseModel):
    """A call an assistant message made: the arguments are JSON text, as OpenAI sends them."""

    model_config = ConfigDict(extra="ignore")

    name: Annotated[Text, Field(min_length=1, max_length=256)]
    arguments: Text = "{}"


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Annotated[Text, Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; checked when a call is forced
    strict: bool | None = None


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[Text, Field(max_length=256)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema replies must validate against."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[Text, Field(max_length=64)] = "response"
    description: Text | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """What the reply must be: free text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs 'json_schema': {'name': ..., "
                             "'schema': {...}}")
        return self


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: a conversation, rendered through the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    response_format: ResponseFormat | None = None
    # Tools are checked against the chat template and tool_choice by engine/api_request.py
    # (tool_plan); a named tool_choice is checked there too, to name `tool_choice` in the 400.
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI parameters of features this server does not have: refused, never ignored.
    functions: Annotated[Any, _refused("deprecated function calling: use 'tools'")] = None
    function_call: Annotated[Any, _refused("deprecated function calling: use 'tools'")] = None
    audio: Annotated[Any, _refused("no audio output")] = None
    modalities: Annotated[list[str], AfterValidator(_text_only)] | None = None
    prediction: Annotated[Any, _refused("no predicted outputs")] = None
    web_search_options: Annotated[Any, _refused("no web search")] = None
    moderation: Annotated[Any, _refused("no moderation")] = None
    reasoning_effort: Annotated[Any, _refused("the model has no reasoning mode")] = None
    verbosity: Annotated[Any, _refused("the model has no verbosity setting")] = None
    store: Annotated[Any, _refused("replies are not stored", (False,))] = None
    metadata: Annotated[Any, _refused("replies are not stored, so there is nothing to tag",
                                      ({},))] = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_retention: Literal["in_memory"] | None = None
    prompt_cache_options: Annotated[Any, _refused("the prefix cache has no options")] = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def field_path(loc: tuple) -> str:
    """A pydantic error location as the dotted field name a client reads ('messages.0.role')."""
    parts = [str(p) for p in loc if p not in ("body",)]
    # Union members show up as extra location parts ('str', 'list[int]'): they name a type, not
    # a field, so they are dropped.
    return ".".join(p for p in parts if not _is_type_name(p)) or "body"


def _is_type_name(part: str) -> bool:
    return any(c in part for c in "[]") or part in {"str", "int", "float", "bool",
                                                    "function-after", "constrained-str",
                                                    "constrained-int", "constrained-float"}
