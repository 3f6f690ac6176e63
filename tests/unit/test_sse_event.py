"""A streamed chunk is one line for every client's line splitting, and the same JSON."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conveyor.server.openai_api.responses import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    ErrorInfo,
)
from conveyor.server.openai_api.streaming import TextChunks, sse

# U+0085, U+2028 and U+2029 are line breaks to str.splitlines; JSON keeps them raw in strings.
TEXT = "a\u2028b\x85c\u2029d\n\"e\\\u2028 \U0001f600"


def test_line_breaks_inside_strings_are_escaped() -> None:
    event = sse(ErrorInfo(message=TEXT, type="x").model_dump_json())
    lines = event.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][len("data: "):])["message"] == TEXT


@pytest.mark.parametrize("text", ["plain ascii", "caf\u00e9 \U0001f600", "\u00e9\x85", "\u00e9\u2028", "x\u2029"])
def test_each_line_break_alone_is_escaped_and_other_text_kept(text: str) -> None:
    payload = json.dumps({"text": text}, ensure_ascii=False)
    event = sse(payload)
    assert event.endswith("\n\n") and event.splitlines()[1:] == [""]
    assert json.loads(event[len("data: "):])["text"] == text
    if not any(c in text for c in "\x85\u2028\u2029"):
        assert event == f"data: {payload}\n\n"


def test_httpx_reads_the_event_whole() -> None:
    """httpx's aiter_lines (str.splitlines) cut the raw form of this event in two."""
    body = sse(ErrorInfo(message=TEXT, type="x").model_dump_json()).encode()

    async def lines() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://test/") as response:
                return [line async for line in response.aiter_lines() if line]

    got = asyncio.run(lines())
    assert len(got) == 1 and json.loads(got[0][len("data: "):])["message"] == TEXT


@pytest.mark.parametrize("text", [TEXT, "plain", " \x00\x1b\t\x7f é 中 </s>"])
def test_text_chunks_from_the_template_are_the_schemas_own(text: str) -> None:
    completion = lambda index, text: CompletionChunk(id="cmpl-1", created=7, model='m "x"', choices=[  # noqa: E731
        CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)]).model_dump_json()
    chat = lambda index, text: ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[  # noqa: E731
        ChatStreamChoice(index=index, delta=ChatDelta(content=text))]).model_dump_json()
    plain_completion = TextChunks(completion(0, ""), '"index":0,"text":""', '"index":{},"text":{}')
    plain_chat = TextChunks(chat(0, ""), '"index":0,"delta":{"content":""}', '"index":{},"delta":{{"content":{}}}')
    assert plain_completion.render(3, text) == sse(completion(3, text))
    assert plain_chat.render(2, text) == sse(chat(2, text))
    assert TextChunks(chat(0, "x"), '"index":0,"delta":{"content":""}', "{}{}").render(0, text) is None
