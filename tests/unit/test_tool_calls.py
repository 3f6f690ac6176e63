"""Hermes / Qwen tool-call parsing, whole and streamed."""

from __future__ import annotations

import json
import random
import re

import pytest

from conveyor.server.parsing.tool_calls import ToolCall, ToolCallStreamParser, parse_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
INVALID = "<tool_call>\nnot json at all\n</tool_call>"


def pairs(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream(text: str, sizes: list[int]) -> tuple[str, list[ToolCall], list[str]]:
    """Feed text in chunks of the given sizes (the last chunk takes the rest)."""
    parser = ToolCallStreamParser()
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    for size in [*sizes, len(text)]:
        if pos >= len(text):
            break
        content, new = parser.feed(text[pos : pos + size])
        pieces.append(content)
        calls += new
        pos += size
    rest, more = parser.finish()
    pieces.append(rest)
    calls += more
    assert parser.num_calls == len(calls)
    return "".join(pieces), calls, pieces


def test_single_call():
    content, calls = parse_tool_calls(WEATHER)
    assert content is None
    assert pairs(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].arguments == '{"city": "Paris"}'


def test_parallel_calls():
    content, calls = parse_tool_calls(WEATHER + "\n\n" + TIME + "\n")
    assert content is None
    assert pairs(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_text_before_call():
    content, calls = parse_tool_calls("Let me check the weather.\n\n" + WEATHER)
    assert content == "Let me check the weather."
    assert pairs(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "body",
    [
        "not json at all",
        '{"name": "f", "arguments": {"a": 1}',  # truncated
        '["f", {"a": 1}]',  # not an object
        '{"arguments": {"a": 1}}',  # no name
        '{"name": 3, "arguments": {}}',  # name not a string
        '{"name": "f"}',  # no arguments
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "f", "arguments": "[1, 2]"}',  # string arguments holding a non-object
        '{"name": "f", "arguments": "{oops"}',  # string arguments that are not JSON
        '{"name": "f", "arguments": {"x": NaN}}',  # not JSON, could not be re-serialized as JSON
    ],
)
def test_invalid_block_stays_in_content(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    assert parse_tool_calls(text) == (text, [])


def test_invalid_block_next_to_valid_call():
    content, calls = parse_tool_calls(INVALID + "\n" + WEATHER)
    assert content == INVALID
    assert pairs(calls) == [("get_weather", {"city": "Paris"})]


def test_arguments_as_json_string():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None
    assert calls[0].name == "f"
    assert calls[0].arguments == '{"a": [1, 2]}'


def test_non_ascii_arguments():
    args = '{"ville": "Zürich", "note": "\\u6771\\u4eac"}'
    text = '<tool_call>{"name": "météo", "arguments": ' + args + "}</tool_call>"
    content, calls = parse_tool_calls(text)
    assert content is None
    assert calls[0].name == "météo"
    assert calls[0].arguments == '{"ville": "Zürich", "note": "東京"}'  # not \u-escaped


def test_unterminated_block_stays_in_content():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(text) == (text, [])
    content, calls = parse_tool_calls(WEATHER + "\n" + text)
    assert content == text
    assert pairs(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", ["Hello, world!", "", "a < b and <tool> </tool_call> <tool_cal"])
def test_no_tags(text):
    assert parse_tool_calls(text) == (text, [])


def test_ids_unique_and_well_formed():
    _, calls = parse_tool_calls("\n".join([WEATHER, TIME, WEATHER]))
    _, more = parse_tool_calls(WEATHER)
    _, streamed, _ = stream(WEATHER + TIME, [1] * 400)
    ids = [c.id for c in calls + more + streamed]
    assert len(ids) == 6 and len(set(ids)) == 6
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# --- streaming ---------------------------------------------------------------------------------

CORPUS = [
    WEATHER,
    WEATHER + "\n\n" + TIME + "\n",
    "Let me check the weather.\n\n" + WEATHER,
    "Intro " + WEATHER + " middle\n" + TIME + " outro",
    "  \n" + WEATHER + "\n \n",
    INVALID,
    "x " + INVALID + "\n" + WEATHER + "\n" + INVALID + " y",
    WEATHER + "\n" + '<tool_call>{"name": "f", "arguments": {"a',  # unterminated last block
    "<tool_call><tool_call>" + WEATHER[len("<tool_call>") :],  # first open pairs with the close
    "Plain text, no tags, but a < b and <tool_ and </tool_call>.",
    "Ends with a partial tag <tool_c",
    "<<<tool_call>" + '{"name": "f", "arguments": "{}"}' + "</tool_call>>",
    '<tool_call>{"name": "météo", "arguments": {"v": "東京 </tool_cal"}}</tool_call> fin',
    "",
]


def chunkings(text: str) -> list[list[int]]:
    rng = random.Random(1234)
    sizes = [[1] * len(text), [len(text)], [3] * len(text), [11] * len(text)]
    for _ in range(20):
        sizes.append([rng.randint(1, 8) for _ in range(len(text))])
    return sizes


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_whole_parse(text):
    expected_content, expected_calls = parse_tool_calls(text)
    for sizes in chunkings(text) + [[cut] for cut in range(len(text) + 1)]:
        content, calls, _ = stream(text, sizes)
        assert pairs(calls) == pairs(expected_calls), sizes
        # The stream does not strip its content; the whole parse does.
        assert ((content.strip() or None) if calls else content.strip()) == expected_content, sizes


def test_streaming_drops_whitespace_between_and_after_calls():
    for sizes in ([1] * 400, [400]):
        content, calls, _ = stream("\n" + WEATHER + "\n\n" + TIME + "\n", sizes)
        assert content == ""
        assert len(calls) == 2


def test_streaming_keeps_interior_whitespace():
    # Whitespace before a call that follows text is already sent; after a call it is held until
    # more content shows it is not trailing.
    content, calls, _ = stream("Hi\n" + WEATHER + "\n \n" + TIME + "\n\nDone\n", [1] * 400)
    assert content == "Hi\n\n \n\n\nDone\n"
    assert len(calls) == 2


def test_streaming_emits_content_early_and_holds_tag_prefixes():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello") == ("Hello", [])
    assert parser.feed(" <to") == (" ", [])  # "<to" may start a tool call
    assert parser.feed("p>") == ("<top>", [])
    assert parser.feed(" a<tool_call>{") == (" a", [])
    assert parser.feed('"name": "f", "arguments": {}}</tool_') == ("", [])
    content, calls = parser.feed("call>")
    assert content == "" and pairs(calls) == [("f", {})]
    assert parser.num_calls == 1
    assert parser.finish() == ("", [])


def test_streaming_invalid_block_released_verbatim_on_close():
    parser = ToolCallStreamParser()
    assert parser.feed("<tool_call>oops") == ("", [])
    assert parser.feed("</tool_call>") == ("<tool_call>oops</tool_call>", [])
    assert parser.num_calls == 0


@pytest.mark.parametrize("tail", ["<tool_", '<tool_call>{"name": "f", "argu'])
def test_streaming_finish_returns_held_text(tail):
    parser = ToolCallStreamParser()
    assert parser.feed("Text " + tail) == ("Text ", [])
    assert parser.finish() == (tail, [])
