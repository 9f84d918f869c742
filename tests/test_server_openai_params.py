"""Every OpenAI parameter through the official `openai` client against a real `servescope
serve` on 127.0.0.1 with the demo model: log-probabilities equal to the model's own
log-softmax, prompt scoring (echo, prompt_logprobs), penalties, logit_bias, seed, stop, usage
while streaming, JSON replies through constrained decoding, and a 400 naming every parameter
the server does not implement."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from engine import LLM, SamplingParams
from engine.api_schema import ChatCompletionRequest, CompletionRequest
from engine.grammar import closed_objects
from engine.server import serve

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=2048, max_num_seqs=8)


def _reference(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    """Greedy tokens from the engine and the model's log-softmax at every position, from one
    full forward pass (LLM.prompt_logits) over the prompt and those tokens."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    logp = torch.log_softmax(llm.prompt_logits(prompt_ids + out.token_ids), dim=-1)
    n = len(prompt_ids)
    return {"prompt_ids": prompt_ids, "tokens": out.token_ids, "logp": logp,
            "generated": [float(logp[n - 1 + j, t]) for j, t in enumerate(out.token_ids)],
            "prompt": [float(logp[i - 1, t]) for i, t in enumerate(prompt_ids) if i]}


@pytest.fixture(scope="module")
def reference(llm) -> dict:
    """Computed before the server's loop owns the engine."""
    return {"chat": _reference(llm, llm.chat_prompt(CHAT), 4),
            "completion": _reference(llm, llm.tokenizer.encode(PROMPT), 4)}


@pytest.fixture(scope="module")
def client(llm, reference):
    srv = serve(llm, "127.0.0.1", 0)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    srv.close()


@pytest.fixture(scope="module")
def name(llm) -> str:
    return llm.model_name


def _chat(client, name, **extra):
    return client.chat.completions.create(model=name, messages=CHAT, **(
        {"max_tokens": 4, "temperature": 0} | extra))


# ---- log-probabilities ----
def test_chat_logprobs_are_the_models_log_softmax(client, name, reference):
    ref = reference["chat"]
    out = _chat(client, name, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref["tokens"]) == out.usage.completion_tokens
    rows = ref["logp"][len(ref["prompt_ids"]) - 1:]
    for entry, want, row in zip(content, ref["generated"], rows, strict=False):
        assert entry.logprob == pytest.approx(want, abs=TOL)
        assert entry.bytes == list(entry.token.encode())
        top = [t.logprob for t in entry.top_logprobs]
        assert top == pytest.approx(row.topk(3).values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=TOL)  # greedy
    assert "".join(e.token for e in content) == out.choices[0].message.content
    streamed = [e for chunk in _chat(client, name, logprobs=True, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx(ref["generated"], abs=TOL)
    assert _chat(client, name).choices[0].logprobs is None


def test_completion_logprobs_whole_and_streamed(client, name, reference):
    ref = reference["completion"]
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref["generated"], abs=TOL)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tops, token, chosen in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs, strict=True):
        assert tops[token] == chosen and 1 <= len(tops) <= 3
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=4,
                                            temperature=0, logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [v for s in streamed for v in s.text_offset] == lp.text_offset


def test_echo_scores_the_prompt_with_the_models_log_probabilities(client, name, reference):
    """What the monitor's quality canary sends: echo, logprobs, max_tokens 0."""
    ref = reference["completion"]
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1, extra_body={"prompt_logprobs": 1})
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref["prompt"], abs=TOL)
    prompt_lp = choice.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ref["prompt_ids"])
    for i, (entry, token) in enumerate(zip(prompt_lp[1:], ref["prompt_ids"][1:], strict=True)):
        row = ref["logp"][i]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=TOL)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
    # Echo with generation: the prompt's tokens, then the reply's.
    more = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, echo=True,
                                     temperature=0, logprobs=0).choices[0]
    assert more.text.startswith(PROMPT) and len(more.text) > len(PROMPT)
    assert more.logprobs.token_logprobs[1:] == pytest.approx(ref["prompt"] + ref["generated"],
                                                             abs=TOL)


def test_chat_prompt_logprobs(client, name, reference):
    out = _chat(client, name, max_tokens=1, extra_body={"prompt_logprobs": 0})
    got = out.model_extra["prompt_logprobs"]
    ids = reference["chat"]["prompt_ids"]
    assert [None if e is None else e[str(t)]["logprob"] for e, t in zip(got, ids, strict=True)
            ][1:] == pytest.approx(reference["chat"]["prompt"], abs=TOL)


# ---- sampling ----
def test_logit_bias_forces_and_forbids_tokens(client, name, llm, reference):
    forced = llm.tokenizer.encode(" banana")[0]
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100}, logprobs=0)
    assert out.choices[0].text == " banana" * 3
    greedy = reference["completion"]["tokens"][0]
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=1, temperature=0,
                                    logit_bias={str(greedy): -100}, logprobs=0)
    assert out.choices[0].logprobs.tokens[0] != llm.tokenizer.decode([greedy])


REPEAT = "List of fruits: apple, banana,"  # greedy, the model lists pear again and again


def _tokens(client, name, **extra) -> list[str]:
    out = client.completions.create(model=name, prompt=REPEAT, max_tokens=12, temperature=0,
                                    logprobs=0, **extra)
    return out.choices[0].logprobs.tokens


def test_penalties_move_choices_the_expected_way(client, name):
    plain = _tokens(client, name)
    assert len(set(plain)) * 2 < len(plain)  # the model repeats itself here
    for penalty in ("presence_penalty", "frequency_penalty"):
        penalised = _tokens(client, name, **{penalty: 2.0})
        assert len(set(penalised)) > 2 * len(set(plain)), penalty
    rewarded = _tokens(client, name, frequency_penalty=-2.0)
    assert len(set(rewarded)) < len(set(plain))  # a negative penalty rewards repeating


def test_seed_makes_sampling_reproducible(client, name):
    def text(seed):
        return client.completions.create(model=name, prompt="Once upon a time", max_tokens=8,
                                         temperature=1.0, seed=seed).choices[0].text

    assert text(7) == text(7)
    assert text(7) != text(8)


def test_stop_max_completion_tokens_and_streamed_usage(client, name):
    out = _chat(client, name, max_tokens=30, stop=["."])
    assert "." not in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    out = _chat(client, name, max_completion_tokens=3, max_tokens=None)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    chunks = list(_chat(client, name, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.usage is None for c in _chat(client, name, stream=True))


def test_n_choices_are_separate_seeded_samples_whole_and_streamed(client, name):
    kw = {"model": name, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0,
          "seed": 3, "n": 3}
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 3
    first = client.completions.create(**(kw | {"n": 1}))
    assert out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens == first.usage.prompt_tokens  # the prompt counted once
    assert first.choices[0].text == out.choices[0].text  # choice i samples with seed + i
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in out.choices]


# ---- constrained decoding ----
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 3}},
     "required": ["answer", "confidence", "tags"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_replies_validate(client, name, schema):
    out = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=80, temperature=0.8, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "reply",
                                                                "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"


def test_an_object_schema_allows_only_its_properties_unless_it_says_otherwise(client, name):
    """As vLLM's default grammar backend and llama.cpp read a schema: without
    additionalProperties the object holds its listed properties only (the demo model asked
    for a name under JSON Schema's open objects went on nesting more properties until
    max_tokens cut the JSON short); a schema that says additionalProperties keeps its word."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"]}
    ask = [{"role": "user", "content": "Give a JSON object with a name."}]

    def reply(schema: dict):
        return client.chat.completions.create(
            model=name, messages=ask, max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}})

    out = reply(schema)
    assert out.choices[0].finish_reason == "stop"
    assert list(json.loads(out.choices[0].message.content)) == ["name"]
    nested = {"type": "object", "properties": {"people": {"type": "array", "maxItems": 2,
                                                          "items": schema}},
              "required": ["people"]}
    out = reply(nested)
    people = json.loads(out.choices[0].message.content)["people"]
    assert out.choices[0].finish_reason == "stop" and all(list(p) == ["name"] for p in people)
    said = schema | {"additionalProperties": {"type": "integer"}}
    out = reply(said)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), said)


def test_closing_objects_follows_only_subschemas():
    open_ = {"type": "object", "properties": {"a": {"type": "string"}}}
    closed = open_ | {"additionalProperties": False}
    schema = {"type": "object", "$defs": {"d": open_},
              "properties": {
                  "list": {"type": "array", "items": open_},
                  "either": {"anyOf": [open_, {"type": "null"}]},
                  "free": open_ | {"additionalProperties": True},
                  "patterned": open_ | {"patternProperties": {"^x": open_}},
                  "const": {"const": {"properties": 1}},  # a value, not a schema
                  "both": {"allOf": [open_, {"properties": {"b": {"type": "string"}}}]}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and out["$defs"]["d"] == closed
    props = out["properties"]
    assert props["list"]["items"] == closed and props["either"]["anyOf"][0] == closed
    assert props["free"]["additionalProperties"] is True
    assert "additionalProperties" not in props["patterned"]
    assert props["patterned"]["patternProperties"]["^x"] == closed
    assert props["const"] == {"const": {"properties": 1}}
    assert props["both"]["allOf"] == schema["properties"]["both"]["allOf"]
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_json_object_reply_is_an_object(client, name):
    plain = _chat(client, name, max_tokens=12).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)  # without the grammar the model writes prose
    out = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Reply in JSON: what is the capital "
                                                          "of France?"}],
        max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


# ---- refusals ----
def test_another_models_name_is_a_404_as_vllm_answers(client, name):
    with pytest.raises(openai.NotFoundError) as info:
        _chat(client, "gpt-4o")
    assert info.value.body == {"message": f"The model `gpt-4o` does not exist. Valid aliases: "
                                          f"{name}.", "type": "NotFoundError",
                               "param": "model", "code": 404}


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("extra,param", [
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"n": 17}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"store": True}, "store"),
    ({"metadata": {"k": "v"}}, "metadata"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
])
def test_unimplemented_parameters_get_a_400_naming_them(client, name, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, name, **extra)
    assert info.value.body["param"] == param and param in info.value.body["message"]


def test_every_openai_parameter_is_a_field_the_server_checks():
    """None falls through to 'unknown field, ignored': each is implemented or refused."""
    chat = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
    completion = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    assert chat - set(ChatCompletionRequest.model_fields) == set()
    assert completion - set(CompletionRequest.model_fields) == set()
