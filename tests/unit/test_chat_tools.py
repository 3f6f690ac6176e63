"""What the model is shown for tools: a template that reads `tools` gets them and structured tool
calls; one that does not gets the default system block and the Hermes blocks in the text. And what
tool_choice forces: a structural tag for required / a named function, nothing for auto / none."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_bpe_tokenizer

import conveyor.text.tokenizer as tokenizer_module
from conveyor.text.chat_template import compile_chat_template, render_chat_template, takes_tools
from conveyor.server.parsing.chat_tools import DEFAULT_TOOLS_PROMPT, template_input, tool_choice_constraint
from conveyor.server.openai_api.chat_schemas import ChatMessage, NamedToolChoice, ToolDefinition

PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WITH_TOOLS = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
              "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
              "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} "
              "{{ c['function']['arguments'] | tojson }}{% endfor %}\n{% endfor %}")
TOOL = ToolDefinition.model_validate({"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
CONVERSATION = [
    ChatMessage.model_validate({"role": "user", "content": "add 1"}),
    ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}),
    ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "2"}),
]


def render(source: str, messages: list[dict], tools: list[dict] | None) -> str:
    return render_chat_template(compile_chat_template(source), messages, add_generation_prompt=True,
                                bos_token=None, eos_token=None, tools=tools)


def test_a_template_that_reads_tools_gets_them_and_structured_calls() -> None:
    assert takes_tools(WITH_TOOLS) and not takes_tools(PLAIN)
    messages, tools = template_input(CONVERSATION, [TOOL], "auto", template_takes_tools=True)
    assert tools == [{"type": "function", "function": TOOL.function.model_dump(exclude_none=True)}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}   # an object, as templates expect
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}
    text = render(WITH_TOOLS, messages, tools)
    assert text.startswith("TOOLS:add;") and 'CALL add {"a": 1}' in text


def test_a_template_without_tools_gets_the_default_block_and_hermes_text() -> None:
    system = ChatMessage.model_validate({"role": "system", "content": "Be brief."})
    messages, tools = template_input([system, *CONVERSATION], [TOOL], "required", template_takes_tools=False)
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert json.dumps({"type": "function", "function": TOOL.function.model_dump(exclude_none=True)}) in \
        messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n2\n</tool_response>"
    text = render(PLAIN, messages, None)
    assert "<|tool|><tool_response>" in text
    no_system, _ = template_input(CONVERSATION[:1], [TOOL], "auto", template_takes_tools=False)
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith(DEFAULT_TOOLS_PROMPT[:20])


def test_tool_choice_none_shows_no_tools() -> None:
    messages, tools = template_input(CONVERSATION[:1], [TOOL], "none", template_takes_tools=False)
    assert tools is None and [m["role"] for m in messages] == ["user"]


def test_only_required_and_a_named_function_are_grammars() -> None:
    assert tool_choice_constraint([TOOL], "auto", True) is None
    assert tool_choice_constraint([TOOL], "none", True) is None
    required = json.loads(tool_choice_constraint([TOOL], "required", False).structural_tag)
    assert required["format"]["type"] == "tags_with_separator" and required["format"]["stop_after_first"] is True
    assert required["format"]["tags"][0]["begin"] == '<tool_call>\n{"name": "add", "arguments": '
    named = json.loads(tool_choice_constraint([TOOL], NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "add"}}), True).structural_tag)
    assert named["format"]["type"] == "tag" and named["format"]["content"]["json_schema"]["properties"]["a"]


def test_the_tokenizer_parses_a_template_for_tools_once_and_again_when_it_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = tiny_bpe_tokenizer()
    parses: list[str] = []
    monkeypatch.setattr(tokenizer_module, "takes_tools", lambda source: parses.append(source) or takes_tools(source))
    tokenizer.use_chat_template(PLAIN)
    assert [tokenizer.template_takes_tools for _ in range(3)] == [False] * 3
    tokenizer.use_chat_template(WITH_TOOLS)
    assert [tokenizer.template_takes_tools for _ in range(3)] == [True] * 3
    assert parses == [PLAIN, WITH_TOOLS]
    tokenizer.chat_template = None
    assert tokenizer.template_takes_tools is False
