"""The <think> split of reasoning.py on token streams: tags split across deltas anywhere, each parser's
start (inside the thinking or not, from the prompt), whitespace after </think>, and output cut short."""

from __future__ import annotations

import pytest

from conveyor.server.parsing.reasoning import ReasoningStream, split_reasoning, starts_in_reasoning

OUTPUTS = [
    # (output, starts inside the thinking, expected reasoning, expected content)
    ("<think>plan it</think>\n\nThe answer.", False, "plan it", "The answer."),
    ("  <think>a < b</think>ok", False, "a < b", "ok"),
    ("plan it</think>\n\nThe answer.", True, "plan it", "The answer."),
    ("<think>plan it</think>The answer.", True, "plan it", "The answer."),   # R1-0528 writes the tag itself
    ("The answer, no thinking.", False, None, "The answer, no thinking."),
    ("still thinking when max_tokens ran out", True, "still thinking when max_tokens ran out", ""),
    ("<think>cut short </thi", False, "cut short </thi", ""),
    ("</think>", True, "", ""),
    ("x <think>late tag</think> y", False, None, "x <think>late tag</think> y"),
    ("<thinking>not the tag</thinking>", False, None, "<thinking>not the tag</thinking>"),
    ("", True, "", ""),
    ("<think></think>\n\n", False, "", ""),
]


def _stream(text: str, cuts: list[int], in_reasoning: bool) -> tuple[str, str, bool]:
    stream = ReasoningStream(in_reasoning)
    reasoning, content, last = [], [], 0
    for cut in [*cuts, len(text)]:
        r, c = stream.feed(text[last:cut])
        reasoning.append(r)
        content.append(c)
        last = cut
    r, c = stream.finish()
    return "".join(reasoning) + r, "".join(content) + c, stream.thought


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), OUTPUTS)
def test_whole_output_split(text: str, inside: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, inside) == (reasoning, content)


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), OUTPUTS)
def test_every_split_into_one_char_deltas_agrees(text: str, inside: bool, reasoning: str | None,
                                                 content: str) -> None:
    got_reasoning, got_content, thought = _stream(text, list(range(1, len(text))), inside)
    assert (got_reasoning if thought else None, got_content) == (reasoning, content)


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), OUTPUTS[:4])
def test_every_two_way_cut_agrees(text: str, inside: bool, reasoning: str | None, content: str) -> None:
    for cut in range(len(text) + 1):
        assert _stream(text, [cut], inside)[:2] == (reasoning, content), cut


def test_streamed_thinking_is_released_before_the_end_tag_arrives() -> None:
    stream = ReasoningStream(in_reasoning=True)
    assert stream.feed("Let me think") == ("Let me think", "")
    assert stream.feed(" about it </th") == (" about it ", "")   # a possible end tag is held
    assert stream.in_reasoning
    assert stream.feed("ink>\n") == ("", "")                     # whitespace before the answer is held
    assert stream.ended and not stream.in_reasoning
    assert stream.feed("\nYes.") == ("", "Yes.")


@pytest.mark.parametrize(("parser", "prompt", "inside"), [
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜><think>\n", True),
    ("deepseek_r1", "<|im_start|>assistant\n", True),
    ("qwen3", "<|im_start|>assistant\n", False),
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),      # enable_thinking false
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
])
def test_where_the_output_starts(parser: str, prompt: str, inside: bool) -> None:
    assert starts_in_reasoning(parser, prompt) is inside


def test_a_call_written_inside_the_thinking_is_thinking_and_one_after_it_is_a_call() -> None:
    from conveyor.server.openai_api.chat_output import ChatOutputSplitter
    from conveyor.server.parsing.tool_calls import ToolCallStreamParser

    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    text = f"maybe {call}?</think>\n{call}"
    splitter = ChatOutputSplitter(ReasoningStream(in_reasoning=True), ToolCallStreamParser(), forces_tool_calls=False)
    reasoning, content, calls = [], [], []
    for i, char in enumerate(text):
        r, c, new = splitter.feed(char, 1, finished=i == len(text) - 1)
        reasoning.append(r)
        content.append(c)
        calls += new
    assert "".join(reasoning) == f"maybe {call}?" and "".join(content) == ""
    assert [c.name for c in calls] == ["f"]
    assert splitter.num_reasoning_tokens == len(f"maybe {call}?</think>")
