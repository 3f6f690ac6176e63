"""/v1/responses through a real server and the official openai client: text or message input with
instructions, max_output_tokens (status incomplete), the same tokens as the chat path, streaming events
in OpenAI's order, a function tool as a function_call output item (plain and streamed), a conversation
continued by previous_response_id with the tool's output, stored responses read and deleted, and
bad input refused in the Responses API's own field names."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_helpers import RunningServer, start_server
from test_errors import assert_error

WEATHER = {"type": "function", "name": "get_weather", "description": "the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0)


def test_text_input_matches_the_chat_path(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    response = client.responses.create(model=tiny_server.model_name, input="What is the capital of France?",
                                       instructions="Answer briefly.", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=tiny_server.model_name, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_message_input_and_streaming_events(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]
    plain = client.responses.create(model=tiny_server.model_name, input=messages, max_output_tokens=8,
                                    temperature=0)
    events = list(client.responses.create(model=tiny_server.model_name, input=messages, max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    with client.responses.stream(model=tiny_server.model_name, input=messages, max_output_tokens=8,
                                 temperature=0) as stream:
        assert stream.get_final_response().output_text == plain.output_text


@pytest.fixture(scope="module")
def bundled_server() -> Iterator[RunningServer]:
    """The bundled model: the tools' system prompt is past the tiny model's 256-token context."""
    pytest.importorskip("gguf")
    pytest.importorskip("xgrammar")
    running = start_server(None, max_num_seqs=2, kv_cache_memory="64MiB")
    yield running
    running.stop()


def test_a_tool_call_then_its_output_continues_the_conversation(bundled_server: RunningServer) -> None:
    tiny_server = bundled_server
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0)
    first = client.responses.create(model=tiny_server.model_name, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=40, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)

    stream = client.responses.create(model=tiny_server.model_name, input="What is the weather in Paris?",
                                     tools=[WEATHER], tool_choice="required", max_output_tokens=40, temperature=0,
                                     stream=True)
    events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        "".join(c.arguments for c in calls)

    follow = client.responses.create(
        model=tiny_server.model_name, previous_response_id=first.id, max_output_tokens=4, temperature=0,
        tools=[WEATHER], input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.previous_response_id == first.id
    # The same conversation sent whole to the chat path: the first input, its calls, the tool's output.
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    chat = client.chat.completions.create(model=tiny_server.model_name, max_tokens=4, temperature=0, tools=[chat_tool],
                                          messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == (chat.choices[0].message.content or "")
    # The same conversation as input items, without the stored response.
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    whole = client.responses.create(model=tiny_server.model_name, input=items, max_output_tokens=4, temperature=0,
                                    tools=[WEATHER])
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.output_text == follow.output_text

    named = client.responses.create(model=tiny_server.model_name, input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]


def test_text_format_json_schema(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response = client.responses.create(model=tiny_server.model_name, input="a digit", max_output_tokens=20,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "digit",
                                                                       "schema": schema}})
    assert 0 <= json.loads(response.output_text)["n"] <= 9
    assert response.text.format.type == "json_schema"


def test_stored_responses_are_read_and_deleted(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    response = client.responses.create(model=tiny_server.model_name, input="hi", max_output_tokens=2)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model=tiny_server.model_name, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=tiny_server.model_name, input="more", previous_response_id=unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input.0.type"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "x" * 10, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
])
def test_bad_input_is_refused_by_its_own_name(tiny_server: RunningServer, body: dict, param: str) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/responses", json=body, timeout=30)
    status = 404 if param == "previous_response_id" else 400
    assert_error(response, status, "not_found_error" if status == 404 else "invalid_request_error", param=param)
