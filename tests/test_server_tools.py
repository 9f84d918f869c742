"""OpenAI tool calling (`tools`, `tool_choice`) through the official `openai` client against a
real `servescope serve` on the demo model: calls forced by constrained decoding (a named
function, "required") on the model's own template, which shows no tools; a Hermes-style
`--chat-template` whose calls the `hermes` parser reads from the model's own text; tool
messages reaching the prompt; 400s naming the parameter; and the parsers on hostile text."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import jsonschema
import openai
import pytest

from engine import LLM
from engine.config import ModelError
from engine.server import serve
from engine.tool_calls import (
    Content,
    HermesScanner,
    Llama3JsonScanner,
    NamedScanner,
    RequiredScanner,
    ToolCall,
    ToolServing,
    ToolSetupError,
    detect_parser,
    required_schema,
)
from tests.test_cli import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 32}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# A Hermes-style template (the format of Hermes 2 Pro and Qwen2.5), on the demo model's ChatML
# tokens: the tools in the system message, calls in <tool_call> tags, results in <tool_response>.
HERMES_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- elif message.role != 'system' %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# A Llama 3.1-style template (its tool prompt and JSON calls, results in an `ipython` turn), on
# the same ChatML tokens.
LLAMA3_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\nYou have access to the following functions. To call a function, ' }}
{{- 'please respond with JSON for a function call. Respond in the format {"name": function ' }}
{{- 'name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}{{- (t | tojson(indent=4)) + '\n\n' }}{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' }}
{%- for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "parameters": ' }}
{{- (call.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>ipython\n' + message.content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def _call(city: str, call_id: str = "call_1") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]}


def _user(city: str) -> dict:
    return {"role": "user", "content": f"What is the weather in {city}?"}


# Earlier turns in which the assistant answered with calls: the 135M demo model then writes
# the next call in the template's format itself (asked cold, it answers in prose).
FEW_SHOT = [_user("London"), _call("London"), _user("Berlin"), _call("Berlin"), _user("Paris")]


# ---- the parsers, on text ----
def _fed(scanner, text: str, step: int = 1) -> list:
    """The pieces a stream gives, fed `step` characters at a time."""
    pieces = []
    for end in range(step, len(text), step):
        pieces += scanner.feed(text[:end], final=False)
    return pieces + scanner.feed(text, final=True)


def _summary(pieces: list) -> tuple[str, list]:
    """The content and the calls (name, arguments as objects) of some pieces."""
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]
    return content, calls


NAMES = frozenset({"get_weather", "get_time"})
HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>', "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me look.\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call> ok',
     "Let me look.\n\n ok", [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome"})]),
    # The end tag cut off (a stop string, max_tokens): complete JSON is still the call.
    ('<tool_call>{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_c', "", [("get_time", {})]),
    # Hostile or malformed: all of it stays content.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', None, []),
    ('<tool_call>{name: get_weather}</tool_call>', None, []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None, []),
    ('<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>', None, []),
    ('<tool_call>{"name": "get_time", "arguments": {}} trailing</tool_call>', None, []),
    ('<tool_call>["get_time"]</tool_call>', None, []),
    ("<tool_call><tool_call></tool_call>", None, []),
    ("a < b and <tool_ca", None, []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES, ids=range(len(HERMES_CASES)))
def test_hermes_parser_whole_and_streamed_agree(text, content, calls):
    whole = _summary(HermesScanner(NAMES).feed(text, final=True))
    assert whole == (text if content is None else content, calls)
    for step in (1, 3, 7):
        assert _summary(_fed(HermesScanner(NAMES), text, step)) == whole


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    ('  \n{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    # Prose quoting JSON is content (vLLM's streaming parser reads the start only, too).
    ('The call is {"name": "get_time", "parameters": {}}', None, []),
    ('{"name": "get_time", "parameters": {}} and then prose', None, []),
    ('{"name": "get_time", "parameters": {', None, []),
    ('{"name": "nope", "parameters": {}}', None, []),
    ('{"city": "Paris"}', None, []),
    ("<|python", None, []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES, ids=range(len(LLAMA_CASES)))
def test_llama3_json_parser_whole_and_streamed_agree(text, content, calls):
    whole = _summary(Llama3JsonScanner(NAMES).feed(text, final=True))
    assert whole == (text if content is None else content, calls)
    for step in (1, 4):
        assert _summary(_fed(Llama3JsonScanner(NAMES), text, step)) == whole


def test_the_parsers_never_fail_on_random_text():
    """Fragments of the formats shuffled together: whatever comes, pieces, never an error, and
    a stream's pieces are the whole reply's."""
    parts = ["<tool_call>", "</tool_call>", "<tool_", "{", "}", '"name"', ":", '"get_time"',
             '"arguments"', '"parameters"', "{}", ",", "[", "]", ";", " ", "\n", "\\", '"',
             "<|python_tag|>", "é", "text"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))
        for scanner in (HermesScanner, Llama3JsonScanner, RequiredScanner):
            whole = _summary(scanner(NAMES).feed(text, final=True))
            assert _summary(_fed(scanner(NAMES), text, rng.randint(1, 5))) == whole


def test_required_and_named_replies_are_read_as_calls():
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}]'
    assert _summary(RequiredScanner(NAMES).feed(text, True)) == ("", [("get_time",
                                                                       {"zone": "CET"})])
    cut = '[{"name": "get_time", "parameters": {"zo'  # max_tokens cut it: content
    assert _summary(RequiredScanner(NAMES).feed(cut, True)) == (cut, [])
    named = NamedScanner("get_time")
    first = named.feed('{"zone"', False)
    assert [(p.name, p.arguments) for p in first] == [("get_time", '{"zone"')]
    assert [p.text for p in named.feed('{"zone": "UTC"}', True)] == [': "UTC"}']


def test_the_parser_is_picked_from_the_chat_template():
    assert detect_parser(HERMES_TEMPLATE) == "hermes"
    llama = ("{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary "
             "of argument name and its value}.' }}{% for t in tools %}{{ t | tojson }}{% endfor %}")
    assert detect_parser(llama) == "llama3_json"
    assert detect_parser("{{ messages }}") is None
    serving = ToolServing.for_template(HERMES_TEMPLATE, override=True)
    assert (serving.parser, serving.renders_tools, serving.renders_tool_calls) == \
        ("hermes", True, True)
    plain = ToolServing.for_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert (plain.parser, plain.renders_tools) == (None, False)
    with pytest.raises(ToolSetupError, match="--chat-template"):
        ToolServing.for_template("{{ messages }}", parser="hermes")
    with pytest.raises(ToolSetupError, match="--tool-call-parser"):
        ToolServing.for_template("{{ messages }}{{ tools }}", auto_tool_choice=True)
    with pytest.raises(ToolSetupError, match="hermes, llama3_json"):
        ToolServing.for_template(HERMES_TEMPLATE, parser="mistral")
    # A model's own template that does not parse still serves (each chat request says why it
    # fails); a --chat-template that does not parse stops the start.
    assert not ToolServing.for_template("{% for %}").renders_tools
    with pytest.raises(ModelError, match="does not parse"):
        ToolServing.for_template("{% for %}", override=True)


def test_required_schema_is_an_array_of_the_tools_calls():
    schema = required_schema(TOOLS)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "rm", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1


# ---- the server on the demo model's own template ----
@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=4096, max_num_seqs=8)


@pytest.fixture(scope="module")
def client(llm):
    srv = serve(llm, "127.0.0.1", 0)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    srv.close()


@pytest.fixture(scope="module")
def name(llm) -> str:
    return llm.model_name


def _chat(client, name, messages=ASK, **extra):
    return client.chat.completions.create(model=name, messages=messages, **(
        {"max_tokens": 80, "temperature": 0} | extra))


def _valid_call(call) -> dict:
    """A tool call's arguments, checked: JSON valid against its function's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _streamed(client, name, messages=ASK, **extra) -> tuple[str, dict, str]:
    """A streamed reply put together as a client does: content, calls by index, finish."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, name, messages, stream=True, **extra):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta of a call names it
                assert delta.id.startswith("call_") and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                      "arguments": ""}
            else:
                assert delta.id is None and not delta.function.name
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def _prompt_text(reply) -> str:
    """The prompt as the engine saw it, from vLLM's prompt_logprobs (each position's own token
    first; the first token has none)."""
    entries = reply.model_extra["prompt_logprobs"][1:]
    return "".join(next(iter(e.values()))["decoded_token"] for e in entries)


def test_a_named_function_is_called_with_arguments_valid_for_its_schema(client, name):
    out = _chat(client, name, tools=TOOLS, tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert _valid_call(call)["city"]
    content, calls, finish = _streamed(client, name, tools=TOOLS, tool_choice=NAMED)
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_the_openai_stream_helper_accepts_streamed_calls(client, name):
    with client.chat.completions.stream(model=name, messages=ASK, tools=TOOLS, max_tokens=80,
                                        temperature=0, tool_choice=NAMED) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    assert "tool_calls.function.arguments.done" in events
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert _valid_call(call)


def test_required_calls_one_of_the_tools(client, name):
    out = _chat(client, name, tools=TOOLS, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _valid_call(call)
    content, calls, finish = _streamed(client, name, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    single = _chat(client, name, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_forced_call_tells_the_model_the_tools(client, name):
    """The demo template shows no tools: the server tells them in a system message."""
    out = _chat(client, name, tools=TOOLS, tool_choice=NAMED, extra_body={"prompt_logprobs": 0})
    prompt = _prompt_text(out)
    assert "Current weather in a city" in prompt and "get_time" in prompt
    assert "Call the function get_weather" in prompt and prompt.endswith("assistant\n")


def test_tool_choice_none_offers_no_tools(client, name):
    plain = _chat(client, name, max_tokens=8)
    out = _chat(client, name, max_tokens=8, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_messages_reach_the_prompt(client, name):
    """The demo template cannot render calls: the call is in the assistant's content as JSON,
    the tool's result in a tool turn."""
    messages = [_user("Oslo"), _call("Oslo", "call_7"),
                {"role": "tool", "tool_call_id": "call_7", "content": '{"temperature": -3}'}]
    out = _chat(client, name, messages, max_tokens=4, tools=TOOLS, tool_choice="none",
                extra_body={"prompt_logprobs": 0})
    prompt = _prompt_text(out)
    assert ('assistant\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
            '"celsius"}}<|im_end|>') in prompt
    assert 'tool\n{"temperature": -3}<|im_end|>' in prompt


BAD_CHOICES = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}},
     "tool_choice", "rm_rf"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "'required'"),
    ({"tools": TOOLS, "tool_choice": {"type": "web", "function": {"name": "get_time"}}},
     "tool_choice", "'function'"),
    ({"tool_choice": NAMED}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS}, "tools", "--chat-template"),  # auto: the template shows no tools
    ({"tools": TOOLS, "tool_choice": "auto"}, "tools", "--tool-call-parser"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools", "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
]


@pytest.mark.parametrize("extra,param,says", BAD_CHOICES, ids=range(len(BAD_CHOICES)))
def test_bad_tools_or_tool_choice_get_a_400_naming_them(client, name, extra, param, says):
    extra = dict(extra)
    body = {k: extra.pop(k) for k in ("ignore_eos",) if k in extra}
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, name, extra_body=body or None, **extra)
    error = info.value.body
    assert error["param"].split(".")[0] == param and param in error["message"]
    assert says in error["message"]


def test_each_choice_makes_its_own_call(client, name):
    out = _chat(client, name, tools=TOOLS, tool_choice=NAMED, n=2, temperature=1.0, seed=3)
    assert len(out.choices) == 2
    ids = set()
    for choice in out.choices:
        [call] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and _valid_call(call)
        ids.add(call.id)
    assert len(ids) == 2


def test_a_forced_call_is_refused_while_speculating():
    """Speculation verifies drafts against the model's own distribution: a grammar would be
    ignored there, so a forced call is a 400 (tool_choice auto still works)."""
    from types import SimpleNamespace

    from engine.api_request import ApiError, check_fields
    from engine.api_schema import ChatCompletionRequest

    speculating = SimpleNamespace(spec=object(), config=SimpleNamespace(vocab_size=100))
    body = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required")
    with pytest.raises(ApiError) as info:
        check_fields(body, True, speculating)
    assert info.value.param == "tool_choice" and "--speculative" in str(info.value)
    check_fields(body.model_copy(update={"tool_choice": "auto"}), True, speculating)


def test_a_bad_call_in_the_history_is_a_400_not_a_500(client, name):
    messages = [_user("Oslo"), {"role": "assistant", "tool_calls": [{"type": "function"}]}]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, name, messages, max_tokens=2)
    assert info.value.body["param"].startswith("messages")


# ---- another --chat-template: tool_choice auto, the parser its format needs ----
@pytest.fixture(scope="module")
def template_llm(demo_gguf):
    """The engine behind the servers with another chat template, one after the other."""
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=4096, max_num_seqs=8)


def _template_client(llm, template: str):
    serving = ToolServing.for_template(template, override=True)
    srv = serve(llm, "127.0.0.1", 0, tools=serving)
    return srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0,
                              timeout=120)


@pytest.fixture(scope="class")
def hermes_client(template_llm):
    srv, client = _template_client(template_llm, HERMES_TEMPLATE)
    yield client
    srv.close()


@pytest.fixture(scope="class")
def llama3_client(template_llm):
    srv, client = _template_client(template_llm, LLAMA3_TEMPLATE)
    yield client
    srv.close()


class TestHermesTemplate:
    """A Hermes-style template: the hermes parser, picked from its text."""

    def test_the_template_gets_the_tools_calls_and_results(self, hermes_client, name):
        messages = [_user("Oslo"), _call("Oslo", "call_7"),
                    {"role": "tool", "tool_call_id": "call_7", "content": '{"temperature": -3}'},
                    _user("And in Rome?")]
        out = _chat(hermes_client, name, messages, max_tokens=2, tools=TOOLS, tool_choice=NAMED,
                    extra_body={"prompt_logprobs": 0})
        prompt = _prompt_text(out)
        assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(CLOCK) + "\n</tools>" in prompt
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Oslo", "unit": "celsius"}}\n</tool_call><|im_end|>') in prompt
        assert '<tool_response>\n{"temperature": -3}\n</tool_response>' in prompt
        assert "You can call these functions" not in prompt  # the template shows them itself

    def test_hermes_calls_in_the_models_own_text_are_parsed(self, hermes_client, name):
        out = _chat(hermes_client, name, FEW_SHOT, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and _valid_call(call)["city"] == "Paris"
        assert choice.message.content is None
        content, calls, finish = _streamed(hermes_client, name, FEW_SHOT, tools=TOOLS)
        assert (content.strip(), finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(call.function.name, call.function.arguments)]
        with hermes_client.chat.completions.stream(model=name, messages=FEW_SHOT, tools=TOOLS,
                                                   max_tokens=80, temperature=0) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments

    def test_hermes_replies_cut_short_stay_content(self, hermes_client, name):
        """The model's call cut by max_tokens (invalid JSON in an unclosed tag) is content, whole
        and streamed; cut before its end tag by a stop string, complete JSON is still the call."""
        out = _chat(hermes_client, name, FEW_SHOT, tools=TOOLS, max_tokens=8)
        choice = out.choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert choice.message.content.startswith("<tool_call>")
        content, calls, finish = _streamed(hermes_client, name, FEW_SHOT, tools=TOOLS, max_tokens=8)
        assert (content, calls, finish) == (choice.message.content, {}, "length")
        stopped = _chat(hermes_client, name, FEW_SHOT, tools=TOOLS, stop=["</tool_call>"])
        assert stopped.choices[0].finish_reason == "tool_calls"
        assert _valid_call(stopped.choices[0].message.tool_calls[0])

    def test_prose_is_content_under_auto(self, hermes_client, name):
        out = _chat(hermes_client, name, ASK, tools=TOOLS, max_tokens=12)
        choice = out.choices[0]
        assert choice.message.tool_calls is None and choice.message.content
        assert choice.finish_reason == "length"

    def test_required_with_a_template_that_shows_tools(self, hermes_client, name):
        out = _chat(hermes_client, name, ASK, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False)
        [call] = out.choices[0].message.tool_calls
        assert _valid_call(call) and out.choices[0].finish_reason == "tool_calls"


class TestLlama3Template:
    """A Llama 3.1-style template: the llama3_json parser, picked from its text."""

    def test_the_template_gets_the_tools(self, llama3_client, name):
        out = _chat(llama3_client, name, FEW_SHOT, max_tokens=2, tools=TOOLS,
                    tool_choice=NAMED, extra_body={"prompt_logprobs": 0})
        prompt = _prompt_text(out)
        assert json.dumps(WEATHER, indent=4) in prompt and "dictionary of argument" in prompt
        assert ('assistant\n{"name": "get_weather", "parameters": {"city": "London", "unit": '
                '"celsius"}}<|im_end|>') in prompt

    def test_llama3_calls_in_the_models_own_text_are_parsed(self, llama3_client, name):
        out = _chat(llama3_client, name, FEW_SHOT, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and _valid_call(call)["city"] == "Paris"
        content, calls, finish = _streamed(llama3_client, name, FEW_SHOT, tools=TOOLS)
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(call.function.name, call.function.arguments)]

    def test_llama3_prose_and_cut_calls_stay_content(self, llama3_client, name):
        prose = _chat(llama3_client, name, ASK, tools=TOOLS, max_tokens=12).choices[0]
        assert prose.message.tool_calls is None and prose.message.content
        cut = _chat(llama3_client, name, FEW_SHOT, tools=TOOLS, max_tokens=6).choices[0]
        assert cut.finish_reason == "length" and cut.message.tool_calls is None
        assert cut.message.content.startswith('{"name"')
        content, calls, finish = _streamed(llama3_client, name, FEW_SHOT, tools=TOOLS,
                                           max_tokens=6)
        assert (content, calls, finish) == (cut.message.content, {}, "length")


# ---- the command line ----
def test_servescope_serve_takes_a_chat_template_and_a_parser(demo_gguf, tmp_path):
    import httpx

    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE, encoding="utf-8")
    with serving(demo_gguf, "--kv-cache-tokens", "2048", "--chat-template", str(template),
                 "--tool-call-parser", "hermes", "--enable-auto-tool-choice") as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": FEW_SHOT, "tools": TOOLS, "max_tokens": 80, "temperature": 0})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_servescope_serve_refuses_auto_tool_choice_it_cannot_do(demo_gguf):
    r = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--model", str(demo_gguf),
                        "--port", "0", "--enable-auto-tool-choice"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2 and "--chat-template" in r.stderr
    assert "Traceback" not in r.stderr
