"""The bench's stream reader breaks lines where server-sent events do (LF, CRLF), not at U+2028."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench.serving.client import sse_lines


def test_a_raw_line_separator_stays_inside_its_event() -> None:
    text = "a\u2028b\x85c\u2029d"
    body = (f"data: {json.dumps({'t': text}, ensure_ascii=False)}\r\n\r\ndata: [DONE]\n\n").encode()

    async def read() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://bench/") as response:
                return [line async for line in sse_lines(response) if line]

    lines = asyncio.run(read())
    assert lines == [lines[0], "data: [DONE]"] and json.loads(lines[0][len("data: "):])["t"] == text
