"""--tool-call-parser through a real server and the official openai client, on the bundled model: under
tool_choice auto, a fenced JSON block naming a given tool and a Llama 3 call object become tool calls
(non-streamed and streamed alike); a code block that is not a call stays content. The model is made to
write each form with a one-choice grammar, since the forms are what is under test."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from server_helpers import RunningServer, start_server

pytest.importorskip("gguf")
pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
NOT_A_CALL = '```python\nprint("Paris")\n```'


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(None, max_num_seqs=2, kv_cache_memory="64MiB",
                           server_options={"tool_call_parser": "llama3_json"})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def writing(client: openai.OpenAI, server: RunningServer, text: str, stream: bool):
    return client.chat.completions.create(model=server.model_name, messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=60, stream=stream, extra_body={"guided_choice": [text]})


@pytest.mark.parametrize("text", [FENCED, LLAMA3])
def test_the_form_becomes_a_tool_call(client: openai.OpenAI, server: RunningServer, text: str) -> None:
    choice = writing(client, server, text, stream=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    calls, content, finish = [], [], None
    for chunk in writing(client, server, text, stream=True):
        for delta in chunk.choices:
            calls += delta.delta.tool_calls or []
            content.append(delta.delta.content or "")
            finish = delta.finish_reason or finish
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(content) == "" and finish == "tool_calls"


def test_a_code_block_that_is_not_a_call_stays_content(client: openai.OpenAI, server: RunningServer) -> None:
    choice = writing(client, server, NOT_A_CALL, stream=False).choices[0]
    assert choice.message.content == NOT_A_CALL and not choice.message.tool_calls
    streamed = "".join(delta.delta.content or "" for chunk in writing(client, server, NOT_A_CALL, stream=True)
                       for delta in chunk.choices)
    assert streamed == NOT_A_CALL


@pytest.mark.real_model
def test_a_real_coder_model_under_auto_gets_tool_calls(real_gguf) -> None:
    """Qwen2.5-Coder-0.5B-Instruct answers these with a bare call object and a fenced, pretty-printed one
    (before these parsers both came back as content): `-m real_model --real-gguf FILE` with that file."""
    running = start_server(real_gguf, max_num_seqs=2, kv_cache_memory="128MiB")
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0)
        for question, city in (("What is the weather in Paris?", "Paris"),
                               ("Use the tool to get the weather in Oslo.", "Oslo")):
            choice = client.chat.completions.create(model=running.model_name, tools=[WEATHER], temperature=0,
                                                    max_tokens=80,
                                                    messages=[{"role": "user", "content": question}]).choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content
            assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
                [("get_weather", {"city": city})]
    finally:
        running.stop()
