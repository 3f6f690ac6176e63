"""Server-sent events and the end of a response when the client goes away.

`EventStreamResponse` writes a stream's events and closes its `PromptGroup` (prompt_group.py) however the
response ends; `until_disconnected` cancels work the client no longer waits for; `sse`, `TextChunks` and
the error events are the stream's wire format.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.errors import ConveyorError
from conveyor.server.openai_api.prompt_group import PromptGroup
from conveyor.server.openai_api.responses import ErrorInfo, ErrorResponse

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed its connection before its response was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or raise ClientDisconnected (cancelling it) as soon as the client hangs up."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the server's next message is the disconnect, whenever it comes.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.01)  # an unexpected message: do not spin


class EventStreamResponse(StreamingResponse):
    """Server-sent events that close their PromptGroup however the response ends.

    Starlette cancels the body when the client disconnects, but a body suspended at `yield` is
    never resumed or closed, so the group is closed here rather than in the body's `finally`.
    """

    def __init__(self, content: AsyncIterator[str], group: PromptGroup) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._group.close()


# JSON leaves U+0085, U+2028 and U+2029 raw in strings, and clients that split a stream with
# str.splitlines (httpx's iter_lines among them) cut an event there: sent as escapes, the same JSON.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: str) -> str:
    """One server-sent event of a JSON payload, on one line for every client's line splitting."""
    # Translating every payload cost ~2 us a chunk; ASCII text (most) holds none of the three.
    if not payload.isascii() and ("\x85" in payload or "\u2028" in payload or "\u2029" in payload):
        payload = payload.translate(_LINE_BREAKS)
    return f"data: {payload}\n\n"


class TextChunks:
    """A stream's plain text chunks (text only: no logprobs, no finish reason), written into the JSON of a
    sample chunk that the response's own schema serialized once: building and dumping two pydantic
    models per token cost ~12 us, a sizeable share of what the server spends on a streamed token.

    `empty` is the sample's text part as serialized with index 0 and empty text, `filled` a format
    string taking the index and the JSON-encoded text; a sample without `empty` exactly once gives
    None, and the caller builds the chunk the usual way.
    """

    def __init__(self, sample_json: str, empty: str, filled: str) -> None:
        head, found, tail = sample_json.partition(empty)
        self._parts = (head, tail) if found and empty not in tail else None
        self._filled = filled

    def render(self, index: int, text: str) -> str | None:
        if self._parts is None:
            return None
        head, tail = self._parts
        return sse(head + self._filled.format(index, json.dumps(text, ensure_ascii=False)) + tail)


def error_payload(exc: ConveyorError) -> str:
    return ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param,
                                         code=exc.code)).model_dump_json()


def error_event(exc: ConveyorError) -> str:
    """A mid-stream error, in the shape OpenAI's clients raise as an APIError."""
    return sse(error_payload(exc))

