"""One HTTP request carried from the ingress to a replica's app, and its ASGI messages carried back.

The replica runs conveyor's own app (`server/app.py`) in process: `call_app` plays the server's
part of ASGI for one `ForwardedRequest` and yields the app's messages in batches, which Ray streams
back. The ingress's `RelayResponse` sends them to the client unchanged, so statuses, headers, SSE
events and error bodies are exactly a single server's. When the stream from the replica fails (the
replica died), the client still gets an OpenAI error: a 503 body if nothing was sent yet, else an
error event and `[DONE]` when streaming.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.errors import ConveyorError
from conveyor.server.app import error_response
from conveyor.server.openai_api.streaming import DONE_EVENT, error_event

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-conveyor-replica"   # names the replica that answered, for clients and tests
_ABANDONED_APP_S = 5.0   # after its client left, an app that has not finished by then is cancelled
_END = object()


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


class ReplicaLost(ConveyorError):
    """The replica serving a request died or became unreachable."""

    status = 503
    error_type = "service_unavailable"


async def call_app(app: ASGIApp, request: ForwardedRequest, replica_id: str) -> AsyncIterator[list[Message]]:
    """Run `app` on the request; yield its messages, whatever has queued up since the last batch.

    Closing the generator early (the ingress's client left, so Ray cancelled the call) tells the
    app the client disconnected, which aborts its engine requests as it would on a single server.
    """
    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
        "method": request.method, "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": request.query_string, "headers": list(request.headers), "client": request.client,
        "server": None,
    }
    outbox: asyncio.Queue[Message | BaseException | object] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, replica_id.encode())]}
        outbox.put_nowait(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except BaseException as exc:   # handed to the reader, which raises it where the ingress sees it
            outbox.put_nowait(exc)
            return
        outbox.put_nowait(_END)

    task = asyncio.create_task(run())
    try:
        while True:
            items = [await outbox.get()]
            while not outbox.empty():
                items.append(outbox.get_nowait())
            messages = [item for item in items if isinstance(item, dict)]
            if messages:
                yield messages
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is _END:
                    return
    finally:
        disconnected.set()
        if not task.done():
            asyncio.get_running_loop().call_later(_ABANDONED_APP_S, task.cancel)


class RelayResponse(Response):
    """Sends the replica's messages; the first batch (with the response start) is already here."""

    def __init__(self, first: list[Message], rest: AsyncGenerator[list[Message], None]) -> None:
        self.first = first
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._relay(scope, receive, send)
        finally:
            await self.rest.aclose()   # a client gone mid-stream: this ends the replica's call too

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = is_stream = finished = False
        try:
            async for messages in _chain(self.first, self.rest):
                for message in messages:
                    if message["type"] == "http.response.start":
                        started = True
                        headers = dict(message.get("headers", ()))
                        is_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                    finished = message["type"] == "http.response.body" and not message.get("more_body", False)
                    await send(message)
        except ConveyorError as exc:
            logger.warning("%s %s failed: %s", scope.get("method"), scope.get("path"), exc.message)
            if not started:
                await error_response(exc)(scope, receive, send)
            elif is_stream and not finished:
                body = (error_event(exc) + DONE_EVENT).encode()
                await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                raise   # a body cut short: closing the connection is all that is left
            return
        if not started:
            empty = ConveyorError("the replica ended the request without a response")
            await error_response(empty)(scope, receive, send)
        elif not finished:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _chain(first: list[Message], rest: AsyncIterator[list[Message]]) -> AsyncIterator[list[Message]]:
    yield first
    async for messages in rest:
        yield messages
