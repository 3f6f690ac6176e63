"""Structured outputs and tool calling through a real server and the official openai client, on the
bundled model: JSON mode parses, json_schema validates, guided choice and regex hold, tool_choice
required / named yields tool calls whose arguments validate (streamed too), auto parses the model's
tool-call syntax, a tool round trip renders, logit_bias acts, and no field is accepted then ignored."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import RunningServer, start_server

from conveyor.model.checkpoint import default_model_name, resolve_model_path

pytest.importorskip("gguf")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "genre": {"type": "string", "enum": ["drama", "comedy", "horror"]},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "actor": {"type": "string", "maxLength": 20}, "lead": {"type": "boolean"}},
            "required": ["actor", "lead"]}, "minItems": 1, "maxItems": 2},
        "rating": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["title", "genre", "cast"]},
    {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMA_OF = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = default_model_name(resolve_model_path(None))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(None, max_num_seqs=8, kv_cache_memory="128MiB")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, messages=ASK, max_tokens: int = 80, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **kwargs).choices[0]


def test_front_and_in_process_core_share_one_grammar_cache(server: RunningServer) -> None:
    assert server.server.async_engine.grammars is server.engine.core.structured.compiler


def test_json_mode_parses(client: openai.OpenAI) -> None:
    # The bundled 135M model's greedy JSON may loop (a list counting on) where the KV cache's rounding
    # tips it; this request closes its object in ~66 tokens with a float16 cache.
    choice = chat(client, [{"role": "user", "content": "Give me a short JSON object about a cat."}], max_tokens=150,
                  response_format={"type": "json_object"})
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates(client: openai.OpenAI, schema: dict) -> None:
    choice = chat(client, [{"role": "user", "content": "Answer in JSON."}], max_tokens=150,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_guided_choice_and_regex_hold_on_both_endpoints(client: openai.OpenAI) -> None:
    choice = chat(client, [{"role": "user", "content": "Is the sky blue?"}],
                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.message.content in {"yes", "no", "maybe"}
    completion = client.completions.create(model=MODEL, prompt="Order number:", max_tokens=20, temperature=0,
                                           extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", completion.choices[0].text)
    completion = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert completion.choices[0].text in {"alpha", "beta"}


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_tool_choice_required_yields_valid_tool_calls(client: openai.OpenAI) -> None:
    choice = chat(client, max_tokens=120, tools=TOOLS, tool_choice="required")
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather", "add"})
    single = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(single.message.tool_calls) == 1


def test_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    choice = chat(client, [{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    check_calls(choice.message.tool_calls, {"add"})


@pytest.mark.parametrize(("tool_choice", "parallel", "max_tokens", "finish"), [
    ("required", False, 64, "tool_calls"),
    ("required", False, 200, "tool_calls"),
    ("required", True, 200, "tool_calls"),
    # The model goes on to a second call (44 tokens each) that max_tokens cuts short: it is left out.
    ("required", True, 64, "length"),
    ({"type": "function", "function": {"name": "get_weather"}}, True, 64, "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, True, 200, "tool_calls"),
])
def test_forced_tool_choice_ends_at_the_call(client: openai.OpenAI, tool_choice, parallel: bool, max_tokens: int,
                                             finish: str) -> None:
    """As OpenAI and vLLM answer: the calls and nothing else, content null, finish tool_calls."""
    choice = chat(client, max_tokens=max_tokens, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel)
    assert choice.finish_reason == finish
    assert choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather", "add"})
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=max_tokens,
                                            tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
                                            stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert chunks[-1].finish_reason == finish
    assert sum(len(c.delta.tool_calls or []) for c in chunks) == len(choice.message.tool_calls)


def test_a_reply_without_tool_calls_leaves_the_field_out(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"messages": ASK, "max_tokens": 4})
    assert response.status_code == 200
    message = response.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"]


def test_streamed_tool_calls_arrive_as_openai_sends_them(client: openai.OpenAI) -> None:
    whole = chat(client, max_tokens=120, tools=TOOLS, tool_choice="required")
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=120, tools=TOOLS,
                                            tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": part.id})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_auto_parses_the_models_tool_call_syntax(client: openai.OpenAI) -> None:
    """The output is forced into a tool call with a regex, so the auto parser must find it."""
    block = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>'
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], temperature=0, max_tokens=60,
            tools=TOOLS, stream=stream, extra_body={"guided_regex": block})
        if stream:
            names = [p.function.name for c in response for p in (c.choices[0].delta.tool_calls or [])
                     if c.choices]
            assert names == ["add"]
        else:
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls, {"add"})


def test_tool_round_trip_renders_and_answers(client: openai.OpenAI) -> None:
    first = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.message.tool_calls[0]
    messages = ASK + [first.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = chat(client, messages, max_tokens=30, tools=TOOLS)
    assert second.finish_reason in {"stop", "length", "tool_calls"}
    assert second.message.content or second.message.tool_calls


def test_constrained_and_free_requests_in_one_batch_each_get_what_they_asked(client: openai.OpenAI) -> None:
    free_messages = [{"role": "user", "content": "Tell me about the moon."}]
    alone = chat(client, free_messages, max_tokens=40).message.content
    with ThreadPoolExecutor(6) as pool:
        free = [pool.submit(chat, client, free_messages, 40) for _ in range(3)]
        constrained = [pool.submit(chat, client, [{"role": "user", "content": "Answer in JSON."}], 150,
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "a", "schema": SCHEMAS[0], "strict": True}}) for _ in range(3)]
        assert all(f.result().message.content == alone for f in free)
        for c in constrained:
            jsonschema.validate(json.loads(c.result().message.content), SCHEMAS[0])


def test_logit_bias_changes_the_output(client: openai.OpenAI, server: RunningServer) -> None:
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                      logprobs=1)
    banned = server.engine.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    biased = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logit_bias={str(banned): -100})
    assert biased.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"made_up_field": 1}, "made_up_field"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_unsupported_or_invalid_fields_get_a_400_naming_them(server: RunningServer, body: dict, param: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                          json={"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _tool_with(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "lookup", "parameters": parameters}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "lookup"}}])
@pytest.mark.parametrize(("parameters", "problem"), [
    ({"type": "objekt"}, "at parameters.type"),                                        # the metaschema refuses it
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(open"}}}, "regex"),
    ({"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}, "cannot be enforced"),  # the grammar does
])
def test_every_tool_schema_is_checked_on_arrival(client: openai.OpenAI, tool_choice, parameters: dict,
                                                 problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=4, tools=[WEATHER, _tool_with(parameters)], tool_choice=tool_choice)
    error = caught.value.body
    assert error["param"] == "tools[1].function.parameters"
    assert "tool 'lookup'" in error["message"] and problem in error["message"]
    assert not re.search(r"\.(cc|h|cpp)\b|/project/|\[\d\d:\d\d", error["message"]), error["message"]


def test_grammar_errors_carry_no_library_internals(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}}}})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "defs" in message and not re.search(r"\.(cc|h|cpp)\b|/project/", message), message


def test_harmless_defaults_and_nulls_are_accepted(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 2, "store": False, "modalities": ["text"], "functions": None,
        "service_tier": "auto", "metadata": None, "prompt_cache_key": "abc", "response_format": {"type": "text"}})
    assert response.status_code == 200, response.text
