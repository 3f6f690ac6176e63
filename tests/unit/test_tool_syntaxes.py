"""The tool-call forms of tool_syntaxes.py, whole and streamed one character at a time: fenced JSON
naming a given tool (and a code block that is not a call), Llama 3's python tag and bare call
objects, Mistral's [TOOL_CALLS] list and name[ARGS] forms, and auto picking from the chat template."""

from __future__ import annotations

import json

import pytest

from conveyor.server.parsing.tool_calls import ToolCallStreamParser, parse_tool_calls
from conveyor.server.parsing.tool_syntaxes import resolve_tool_call_parser, syntaxes

NAMES = frozenset({"get_weather", "add"})
FENCED = 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
CASES = [
    # (parser, output, expected content, expected calls as (name, arguments))
    ("hermes", FENCED, "Sure.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '```\n{"name": "add", "parameters": {"a": 1, "b": 2}}\n```', None, [("add", {"a": 1, "b": 2})]),
    ("hermes", '```json\n{"name": "rm_rf", "arguments": {}}\n```', '```json\n{"name": "rm_rf", "arguments": {}}\n```',
     []),
    ("hermes", "Code:\n```python\nprint('hi')\n```\nDone.", "Code:\n```python\nprint('hi')\n```\nDone.", []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),
    ("hermes", '{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}', None, [("add", {"a": 1, "b": 2})]),
    ("hermes", '{"answer": 42}', '{"answer": 42}', []),
    ("hermes", '[1, 2]', '[1, 2]', []),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": '
     '{"a": 3, "b": 4}}', None, [("get_weather", {"city": "Oslo"}), ("add", {"a": 3, "b": 4})]),
    ("llama3_json", '{"name": "Bob", "parameters": {"age": 3}}', '{"name": "Bob", "parameters": {"age": 3}}', []),
    ("llama3_json", 'Here: {"name": "add", "parameters": {"a": 1, "b": 2}}',
     'Here: {"name": "add", "parameters": {"a": 1, "b": 2}}', []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
     '"arguments": {"city": "Rome"}}]', None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', None,
     [("add", {"a": 5, "b": 6}), ("get_weather", {"city": "Lima"})]),
    ("mistral", '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [("add", {"a": 1, "b": 2})]),
    ("mistral", "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
]


def pairs(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_tool_calls(text, syntaxes(parser), NAMES)
    assert (got_content, pairs(got_calls)) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_one_character_at_a_time(parser: str, text: str, content: str | None, calls: list) -> None:
    stream = ToolCallStreamParser(syntaxes(parser), NAMES)
    pieces, got = [], []
    for char in text:
        piece, new = stream.feed(char)
        pieces.append(piece)
        got += new
    rest, more = stream.finish()
    assert pairs(got + more) == calls
    assert ("".join(pieces) + rest).strip() == (content or "")


def test_mistral_tag_opens_a_later_call_too() -> None:
    content, calls = parse_tool_calls('Let me add.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 1}}]',
                                      syntaxes("mistral"), NAMES)
    assert content == "Let me add." and pairs(calls) == [("add", {"a": 1, "b": 1})]
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()   # Mistral's templates refuse other ids


@pytest.mark.parametrize(("template", "parser"), [
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{{- '<|python_tag|>' }}{% if message.role == 'ipython' %}", "llama3_json"),
    ("<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>", "hermes"),
    (None, "hermes"),
])
def test_auto_picks_from_the_chat_template(template: str | None, parser: str) -> None:
    assert resolve_tool_call_parser("auto", template) == parser
    assert resolve_tool_call_parser("mistral", template) == "mistral"
