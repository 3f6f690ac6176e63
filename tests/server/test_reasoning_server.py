"""Reasoning through a real server and the official openai client: a template that opens <think> (as
DeepSeek-R1's and Qwen3's thinking templates do), --reasoning-parser splitting reasoning_content from
the answer (non-streamed and streamed alike), thinking_token_budget forcing </think> after N tokens,
reasoning tokens in usage, JSON schema and tool calls read after the thinking only,
chat_template_kwargs reaching the template (enable_thinking false renders a closed think block: no
reasoning), reasoning_effort / reasoning.effort mapped onto both, and the Responses API's reasoning items."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import RunningServer, start_server
from test_errors import assert_error

from conveyor.server.openai_api.chat_output import EFFORT_BUDGETS

THINK_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools:' }}{% for tool in tools %}{{ ' ' + tool.function.name }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
ASK_TEXT = "What is the capital of France?"
ASK = [{"role": "user", "content": ASK_TEXT}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=4, chat_template=THINK_TEMPLATE,
                           server_options={"reasoning_parser": "qwen3"})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def first_tokens_text(client: openai.OpenAI, server: RunningServer, num_tokens: int) -> str:
    """What the model writes first, unsplit: the same greedy tokens through /v1/completions."""
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    prompt_ids = server.engine.tokenizer.encode(prompt, False)   # as the chat renders it: no BOS added
    return client.completions.create(model=server.model_name, prompt=prompt_ids, max_tokens=num_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_budget_forces_the_end_tag_and_splits_the_thinking(client: openai.OpenAI, server: RunningServer) -> None:
    reply = client.chat.completions.create(model=server.model_name, messages=ASK, temperature=0, max_tokens=20,
                                           extra_body={"thinking_token_budget": 5, "ignore_eos": True})
    message = reply.choices[0].message
    end_tokens = len(server.engine.tokenizer.encode("</think>", False))
    # The forced tag may complete a character the fifth token began: the completion holds that part back.
    assert message.reasoning_content.startswith(first_tokens_text(client, server, 5))
    assert message.content and "</think>" not in message.content
    assert reply.usage.completion_tokens == 20
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5 + end_tokens

    stream = client.chat.completions.create(model=server.model_name, messages=ASK, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"thinking_token_budget": 5, "ignore_eos": True})
    reasoning, content, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == message.reasoning_content
    assert "".join(content) == message.content
    assert usage.completion_tokens_details.reasoning_tokens == 5 + end_tokens


def test_json_schema_applies_after_the_thinking(client: openai.OpenAI, server: RunningServer) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=server.model_name, messages=ASK, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        extra_body={"thinking_token_budget": 4})
    message = reply.choices[0].message
    # The thinking is free text (a grammar from the start would have made it JSON, or nothing), then the
    # forced end tag, then the schema's JSON.
    end_tokens = len(server.engine.tokenizer.encode("</think>", False))
    assert message.reasoning_content and not message.reasoning_content.startswith("{")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4 + end_tokens
    assert 0 <= json.loads(message.content)["n"] <= 99
    assert reply.choices[0].finish_reason == "stop"


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, server: RunningServer) -> None:
    reply = client.chat.completions.create(model=server.model_name, messages=ASK, temperature=0, max_tokens=8,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    # Without the kwarg the template opens <think>: the whole short reply is thinking.
    thinking = client.chat.completions.create(model=server.model_name, messages=ASK, temperature=0, max_tokens=8,
                                              extra_body={"ignore_eos": True}).choices[0].message
    assert thinking.reasoning_content == first_tokens_text(client, server, 8) and thinking.content is None


def test_template_variables_the_request_sets_are_refused(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert_error(response, 400, "invalid_request_error", param="chat_template_kwargs")


def test_a_budget_without_a_reasoning_parser_is_refused(tiny_server: RunningServer) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 2, "thinking_token_budget": 3})
    assert_error(response, 400, "invalid_request_error", param="thinking_token_budget")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                          "required": ["city"], "additionalProperties": False}}}


def test_a_tool_call_follows_the_thinking(client: openai.OpenAI, server: RunningServer) -> None:
    # The model is made to write the call (a one-choice grammar, after the thinking): the split under test.
    pytest.importorskip("xgrammar")
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kwargs = dict(model=server.model_name, messages=ASK, temperature=0, max_tokens=150, tools=[WEATHER],
                  extra_body={"thinking_token_budget": 3, "guided_choice": [written]})
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert message.reasoning_content and message.content is None
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"

    reasoning, calls = [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            calls += choice.delta.tool_calls or []
    assert "".join(reasoning) == message.reasoning_content
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", call.function.arguments)]


def test_responses_api_gives_the_thinking_as_a_reasoning_item(client: openai.OpenAI, server: RunningServer) -> None:
    chat = client.chat.completions.create(model=server.model_name, messages=ASK, temperature=0, max_tokens=6,
                                          extra_body={"ignore_eos": True})
    response = client.responses.create(model=server.model_name, input=ASK[0]["content"], temperature=0,
                                       max_output_tokens=6)
    item = response.output[0]
    assert item.type == "reasoning" and item.content[0].text == chat.choices[0].message.reasoning_content
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens
    events = list(client.responses.create(model=server.model_name, input=ASK[0]["content"], temperature=0,
                                          max_output_tokens=6, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text


def test_budgets_batched_give_what_each_gives_alone(client: openai.OpenAI, server: RunningServer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def ask(budget: int | None) -> tuple[str | None, str | None]:
        extra = {"ignore_eos": True, **({} if budget is None else {"thinking_token_budget": budget})}
        message = client.chat.completions.create(model=server.model_name, messages=ASK, temperature=0,
                                                 max_tokens=16, extra_body=extra).choices[0].message
        return message.reasoning_content, message.content

    budgets = [2, None, 6, 0]
    alone = [ask(budget) for budget in budgets]
    with ThreadPoolExecutor(len(budgets)) as pool:
        assert list(pool.map(ask, budgets)) == alone


def test_reasoning_effort_switches_thinking_and_budgets_it(client: openai.OpenAI, server: RunningServer) -> None:
    """none/minimal: the template's enable_thinking false; low: a budget of EFFORT_BUDGETS['low'] thinking tokens."""
    off = client.responses.create(model=server.model_name, input=ASK_TEXT, max_output_tokens=8, temperature=0,
                                  reasoning={"effort": "none"})
    chat_off = client.chat.completions.create(model=server.model_name, messages=ASK, max_tokens=8,
                                              temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [item.type for item in off.output] == ["message"] and off.reasoning.effort == "none"
    assert off.output_text == chat_off.choices[0].message.content
    minimal = client.chat.completions.create(model=server.model_name, messages=ASK, max_tokens=8,
                                             temperature=0, reasoning_effort="minimal")
    assert minimal.choices[0].message.content == chat_off.choices[0].message.content

    # low is a budget of EFFORT_BUDGETS["low"] thinking tokens: the same reply as asking for that budget.
    low = client.responses.create(model=server.model_name, input=ASK_TEXT, max_output_tokens=8, temperature=0,
                                  reasoning={"effort": "low"})
    budget = client.chat.completions.create(model=server.model_name, messages=ASK, max_tokens=8,
                                            temperature=0,
                                            extra_body={"thinking_token_budget": EFFORT_BUDGETS["low"]})
    assert low.output[0].type == "reasoning"
    assert low.output[0].content[0].text == budget.choices[0].message.reasoning_content
