"""Tool calling for `servescope serve` (OpenAI `tools` / `tool_choice`), modelled on vLLM's.

Three ways a reply becomes tool calls:
- tool_choice "auto": the model writes calls in its family's format, and a parser picked from
  the chat template (or `--tool-call-parser`) finds them: `hermes` (Hermes, Qwen2.5:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) or `llama3_json` (Llama 3.x: the
  reply is `{"name": ..., "parameters": {...}}`, several separated by `;`). Text the parser cannot
  read as a call (an unclosed tag, invalid JSON, a function not offered) stays content.
- a named function: constrained decoding makes the reply that function's arguments (JSON valid
  against its `parameters` schema), as vLLM does.
- "required": constrained decoding makes the reply a JSON array of one or more calls
  `{"name": one of the tools, "parameters": {...}}` (vLLM's anyOf array schema).

A streamed reply goes through the same scanner as a whole one, fed the text so far; it commits
only what no later text can change, so both give the same calls and content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# Llama 3.1-3.3's templates ask for this format in their tool prompt.
_LLAMA3_HINT = '"parameters": dictionary of argument name'


class ToolSetupError(ValueError):
    """A server set-up (chat template, parser) that cannot do what was asked."""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]  # OpenAI's shape: call_ and 24 characters


def detect_parser(template: str) -> str | None:
    """The parser a chat template's own tool format needs, or None when it shows none."""
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or _LLAMA3_HINT in template:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolServing:
    """How a server does tool calling: the chat template in use, what it renders, and the
    parser for tool_choice "auto" (None: "auto" is refused)."""

    template: str
    override: bool = False  # the template came from --chat-template
    parser: str | None = None
    renders_tools: bool = False  # the template reads the `tools` variable
    renders_tool_calls: bool = False  # ... and assistant messages' `tool_calls`

    @classmethod
    def for_template(cls, template: str, parser: str | None = None, override: bool = False,
                     auto_tool_choice: bool = False) -> ToolServing:
        """Raise ToolSetupError for a parser the template cannot use."""
        from engine.config import ModelError
        from engine.tokenizer import template_variables

        if parser is not None and parser not in PARSERS:
            raise ToolSetupError(f"Unknown tool-call parser {parser!r}: choose one of "
                                 f"{', '.join(PARSERS)}.")
        try:
            renders = "tools" in template_variables(template)
        except ModelError:
            if override:
                raise  # --chat-template: say so at start
            renders = False  # the model's own: each chat request will say why it fails
        chosen = parser or (detect_parser(template) if renders else None)
        if parser is not None and not renders:
            raise ToolSetupError(f"--tool-call-parser {parser} needs a chat template that shows "
                                 "the model its tools (this one never reads `tools`): pass "
                                 "--chat-template with one that does.")
        if auto_tool_choice and not renders:
            raise ToolSetupError("--enable-auto-tool-choice needs a chat template that shows the "
                                 "model its tools (this one never reads `tools`): pass "
                                 "--chat-template with one that does, and --tool-call-parser "
                                 "unless its format is one servescope knows.")
        if auto_tool_choice and chosen is None:
            raise ToolSetupError("--enable-auto-tool-choice needs a tool-call parser, and this "
                                 "chat template's tool format is not one servescope knows: pass "
                                 f"--tool-call-parser ({', '.join(PARSERS)}).")
        return cls(template, override, chosen, renders, renders and "tool_calls" in template)


# ---- what a reply is made of ----
@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Arguments:
    """More argument text of call `index` (a named function's reply, streamed)."""

    index: int
    text: str


Piece = Content | ToolCall | Arguments


# ---- scanners: one reply's text, fed as it grows ----
class _Scanner:
    """Fed the whole text so far each time; returns the pieces that became certain since the
    last call. `final` says no more text will come."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.pos = 0  # characters of the text already turned into pieces

    def feed(self, text: str, final: bool) -> list[Piece]:
        raise NotImplementedError


class HermesScanner(_Scanner):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the reply; the rest is content. An
    unclosed last block is a call if its JSON is complete (the end tag may never come: a stop
    token cut it), as vLLM's hermes parser reads it."""

    def feed(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.pos < len(text):
            rest = text[self.pos:]
            start = rest.find(_HERMES_OPEN)
            if start == -1:
                # Hold back what may be the start of a tag until the next text says.
                n = len(rest) if final else len(rest) - _tag_overlap(rest, _HERMES_OPEN)
                self._content(pieces, rest[:n])
                break
            if start > 0:
                self._content(pieces, rest[:start])
                continue
            end = rest.find(_HERMES_CLOSE, len(_HERMES_OPEN))
            if end == -1 and not final:
                break  # inside a block: wait for its end
            block = rest if end == -1 else rest[:end + len(_HERMES_CLOSE)]
            body = rest[len(_HERMES_OPEN):] if end == -1 else rest[len(_HERMES_OPEN):end]
            call = _call(_one_object(body, allow_tail=_HERMES_CLOSE if end == -1 else ""),
                         self.names)
            if call is None:
                self._content(pieces, block)
            else:
                pieces.append(call)
                self.pos += len(block)
        return pieces

    def _content(self, pieces: list[Piece], text: str) -> None:
        if text:
            pieces.append(Content(text))
            self.pos += len(text)


class Llama3JsonScanner(_Scanner):
    """A reply that starts with a JSON object (or `<|python_tag|>`) is calls, separated by `;`;
    any other reply is content. vLLM's non-streaming llama3_json parser also takes JSON objects
    later in the text, which turns prose quoting JSON into calls; its streaming parser, like this
    one, looks at the start only, so streamed and whole replies agree."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.mode: str | None = None  # "content" or "calls" once the start has shown which

    def feed(self, text: str, final: bool) -> list[Piece]:
        if self.mode is None:
            self.mode = self._mode(text, final)
        if self.mode == "content":
            rest, self.pos = text[self.pos:], len(text)
            return [Content(rest)] if rest else []
        if self.mode is None or not final:
            return []  # a call's JSON is read whole, at the end
        calls = self._calls(text)
        self.pos = len(text)
        return calls if calls else [Content(text)] if text else []

    @staticmethod
    def _mode(text: str, final: bool) -> str | None:
        head = text.lstrip()
        if head.startswith(("{", _PYTHON_TAG)):
            return "calls"
        if not final and (not head or _PYTHON_TAG.startswith(head)):
            return None  # too early to tell
        return "content"

    def _calls(self, text: str) -> list[ToolCall] | None:
        rest = text.lstrip().removeprefix(_PYTHON_TAG)
        calls = []
        decoder = json.JSONDecoder()
        while rest.strip(" \t\r\n;"):
            rest = rest.lstrip(" \t\r\n;")
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            call = _call(obj, self.names)
            if call is None:
                return None  # one unreadable call: the whole reply stays content, as vLLM's
            calls.append(call)
            rest = rest[end:]
        return calls


class NamedScanner(_Scanner):
    """The reply is the named function's arguments (the grammar made it so)."""

    def __init__(self, name: str) -> None:
        super().__init__(frozenset({name}))
        self.name = name
        self.started = False

    def feed(self, text: str, final: bool) -> list[Piece]:
        new, self.pos = text[self.pos:], len(text)
        if not self.started and (new or final):
            self.started = True
            return [ToolCall(self.name, new)]
        return [Arguments(0, new)] if new else []


class RequiredScanner(_Scanner):
    """The reply is a JSON array of calls (the grammar made it so); read whole at the end. A
    reply cut short (max_tokens) stays content."""

    def feed(self, text: str, final: bool) -> list[Piece]:
        if not final:
            return []
        self.pos = len(text)
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        calls = [_call(item, self.names) for item in items or []] \
            if isinstance(items, list) else [None]
        if not calls or None in calls:
            return [Content(text)] if text else []
        return calls


# ---- the plan of one request ----
@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools do: which are shown to the template, how the reply is read
    and constrained."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None = None  # as the request sent them; None: not offered
    parser: str | None = None  # mode "auto"
    function: str | None = None  # mode "named"
    parallel: bool = True  # parallel_tool_calls
    prompt: str | None = None  # told in a system message when the template shows no tools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or [])

    def scanner(self) -> _Scanner | None:
        if self.mode == "auto":
            cls = HermesScanner if self.parser == "hermes" else Llama3JsonScanner
            return cls(self.names)
        if self.mode == "named":
            return NamedScanner(self.function)
        if self.mode == "required":
            return RequiredScanner(self.names)
        return None

    def schema(self) -> dict | None:
        """The JSON schema the reply is constrained to (None: free text)."""
        if self.mode == "named":
            return _parameters(self._tool(self.function))
        if self.mode == "required":
            return required_schema(self.tools, self.parallel)
        return None

    def _tool(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's schema for tool_choice "required": an array of calls, each one of the tools by name
    with its parameters; the tools' `$defs` moved to the top, where their `$ref`s point."""
    defs: dict = {}
    variants = []
    for tool in tools:
        function = tool["function"]
        params = dict(_parameters(function))
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise ToolSetupError(f"the parameters of {function['name']!r} have a '$defs' that "
                                 "is not an object")
        for name, schema in own.items():
            if defs.setdefault(name, schema) != schema:
                raise ToolSetupError(f"two tools define '$defs' entry {name!r} differently: "
                                     "give them distinct names")
        variants.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [function["name"]]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema | ({"$defs": defs} if defs else {})


def default_tool_prompt(tools: list[dict], mode: str, function: str | None) -> str:
    """What a model whose template shows no tools is told when a call is forced: the tools as
    JSON schemas, and the form the (constrained) reply takes."""
    listed = json.dumps([{k: v for k, v in t["function"].items() if k != "strict"}
                         for t in tools], ensure_ascii=False)
    if mode == "named":
        ask = f"Call the function {function}: reply with its arguments as one JSON object."
    else:
        ask = ('Call one or more of them: reply with a JSON array of calls, each '
               '{"name": function name, "parameters": its arguments}.')
    return f"You can call these functions, described as JSON schemas:\n{listed}\n{ask}"


def call_for_template(call: dict) -> dict:
    """An assistant message's call as chat templates read it (HF's form): the arguments as an
    object, which templates write with `tojson`; text that is not JSON is kept as text."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return out | ({"id": call["id"]} if call.get("id") else {})


def call_as_text(call: dict) -> str:
    """A call written into the content, for a template that cannot render calls."""
    function = call_for_template(call)["function"]
    return json.dumps(function, ensure_ascii=False)


# ---- helpers ----
def _parameters(function: dict) -> dict:
    # OpenAI: no `parameters` means a function without arguments.
    return function.get("parameters") or {"type": "object", "properties": {}}


def _tag_overlap(text: str, tag: str) -> int:
    """How many of text's last characters are the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _one_object(body: str, allow_tail: str = ""):
    """The JSON object that is `body` (whitespace around it allowed, and a tail that is the
    start of `allow_tail`), else None."""
    body = body.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    tail = body[end:].strip()
    return obj if not tail or (allow_tail and allow_tail.startswith(tail)) else None


def _call(obj, names: frozenset[str]) -> ToolCall | None:
    """A call from {"name": ..., "arguments" or "parameters": {...}} (Llama writes the one, Hermes
    the other); None unless it names an offered function with object arguments (a string holding
    a JSON object is read too)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
