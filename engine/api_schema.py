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
UNSUPPORTED = ("tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
               "prediction")


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


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's top_k and
    ignore_eos, plus servescope's per-request KV eviction)."""

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
    n: Annotated[int, Field(ge=1, le=1)] = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None
    logit_bias: dict | None = None
    # OpenAI parameters of features this server does not have: refused, never ignored.
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    prediction: Any = None
    modalities: list[Literal["text"]] | None = None
    kv_policy: Annotated[Text, AfterValidator(_known_policy)] | None = None
    kv_budget: Annotated[int | float | str, AfterValidator(_valid_budget)] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        # logprobs is false/null when unused (chat: a bool, completions: a count or null).
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not returned by this server yet: leave 'logprobs' "
                             "unset")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported by this server yet: leave it at 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server yet: leave it unset")
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this server (no tool calling or "
                                 "audio): leave it unset")
        return self

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
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    def prompt_value(self) -> str | list[int]:
        """The single prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: a conversation, rendered through the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    tools: Annotated[list, Field(max_length=0)] | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _plain_text_only(self):
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format other than text is not supported yet: leave "
                             "'response_format' unset")
        return self

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
