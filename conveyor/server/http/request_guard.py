"""The request guard: what every HTTP request passes before the app sees it, and OpenAI error bodies.

Order, cheapest first, so a client without the key cannot make the server do anything for it:
the API key is checked on the headers alone (401 at once, the body never read); then the body is
read up to its size limit and within its time limit, and its JSON nesting bounded; only then does
a request to a route that runs the model take one of the `max_concurrency` slots. A slow body,
a wrong key, the docs, /health, /metrics or the live view never hold a slot, so no number of
them can turn the clients with the key away.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.config import ServerConfig
from conveyor.errors import (
    ConveyorError,
    InvalidRequest,
    RequestTimeout,
    RequestTooLarge,
    ServerBusy,
    Unauthorized,
)
from conveyor.server.batch.api import is_batch_request
from conveyor.server.http.json_depth import MAX_JSON_DEPTH, nests_deeper_than
from conveyor.server.live_view import EVENTS_PATH
from conveyor.server.openai_api.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# The routes that take a concurrency slot (llama.cpp's /completion too).
MODEL_PATHS = ("/v1/completions", "/v1/chat/completions", "/completion", "/completions")
_THREAD_SCAN_BYTES = 256 * 1024   # bodies past this are scanned for nesting on a worker thread
# No route reads the body of a GET (or HEAD, DELETE, OPTIONS); these need no key on /health, /docs
# and /metrics, so their bodies are kept small, or clients without the key could hold megabytes each.
_MAX_BODYLESS_BYTES = 64 * 1024
_BODY_METHODS = ("POST", "PUT", "PATCH")


def error_response(exc: ConveyorError) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param, code=exc.code))
    headers: dict[str, str] = {}
    if exc.status == 429 or isinstance(exc, ServerBusy):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    elif exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


class RequestGuard:
    """ASGI middleware: the API key, the body limit, timeout and nesting, then the concurrency cap.

    The cap counts requests in progress on MODEL_PATHS, streams until their last event included,
    from the moment their body has arrived.

    The body is read here, up to the limit, whatever Content-Length says (it may be absent or
    wrong), and replayed to the app; after the replay the app's receive reaches the server again,
    so disconnects are still seen.
    """

    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app = app
        self.max_concurrency = server.max_concurrency
        self.num_in_progress = 0
        self.expected_auth = f"Bearer {server.api_key}".encode() if server.api_key is not None else None
        keyed = ("/v1/", "/tokenize", "/detokenize", EVENTS_PATH, "/completion", "/props", "/slots")
        self.protected_paths = (*keyed, "/metrics") if server.protect_metrics else keyed
        self.max_body_bytes = server.max_body_bytes
        self.body_timeout_s = server.body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected_auth is not None and scope["path"].startswith(self.protected_paths):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected_auth):
                message = "missing API key" if not given else "invalid API key"
                await _refuse(Unauthorized(f"{message}; send 'Authorization: Bearer <key>'"), scope, receive, send)
                return
        body = await self._read_body(scope, headers, receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        if scope["path"] not in MODEL_PATHS or is_batch_request(scope):   # a batch job's line yields, never counts
            await self._answer_bugs(scope, replay, send)
            return
        if self.max_concurrency is not None and self.num_in_progress >= self.max_concurrency:
            await _refuse(ServerBusy(f"the server has {self.max_concurrency} requests in progress, its "
                                     f"limit; retry later"), scope, replay, send)
            return
        self.num_in_progress += 1
        try:
            await self._answer_bugs(scope, replay, send)
        finally:
            self.num_in_progress -= 1

    async def _read_body(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive,
                         send: Send) -> bytearray | None:
        """The whole body, or None once the request was answered (too large, too slow, too deep, gone)."""
        limit = self.max_body_bytes if scope["method"] in _BODY_METHODS else _MAX_BODYLESS_BYTES
        too_large = RequestTooLarge(f"the request body is larger than the server's limit of {limit} bytes"
                                    f"{'' if scope['method'] in _BODY_METHODS else ' for a ' + scope['method']}")
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            await _refuse(InvalidRequest("invalid Content-Length header"), scope, receive, send)
            return None
        if declared is not None and int(declared) > limit:
            await _refuse(too_large, scope, receive, send)
            return None
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):   # a slow body must not hold a connection
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None  # the client left before sending its body
                    body += message.get("body", b"")
                    if len(body) > limit:
                        await _refuse(too_large, scope, receive, send)
                        return None
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _refuse(RequestTimeout(f"the request body did not arrive within {self.body_timeout_s:g} s"),
                          scope, receive, send)
            return None
        data = bytes(body)
        content_type = headers.get(b"content-type", b"application/json")   # FastAPI reads a body without one as JSON
        if _is_json_sent_as_form(content_type, data):
            # `curl -d '{...}'` labels JSON as a form: read as what it is, as vLLM and llama-server do.
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
            content_type = b"application/json"
        is_json = b"json" in content_type.lower()
        too_deep = is_json and (await asyncio.to_thread(nests_deeper_than, data) if len(data) > _THREAD_SCAN_BYTES
                                else nests_deeper_than(data))
        if too_deep:
            await _refuse(InvalidRequest(f"the request body nests JSON arrays or objects more than "
                                         f"{MAX_JSON_DEPTH} levels deep"), scope, receive, send)
            return None
        return body

    async def _answer_bugs(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; a bug before the response started becomes one logged traceback and a 500
        with an OpenAI body. (Left to Starlette, its handler answers and then re-raises, so the
        server logs the same traceback a second time.)"""
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise   # too late for an error body; the server logs it and closes the connection
            logger.error("%s %s raised", scope["method"], scope["path"], exc_info=exc)
            await error_response(ConveyorError(f"internal server error: {type(exc).__name__}"))(scope, receive, send)


def _is_json_sent_as_form(content_type: bytes, body: bytes) -> bool:
    """A body labelled as a form or plain text whose content is a JSON object."""
    kind = content_type.split(b";")[0].strip().lower()
    return kind in (b"application/x-www-form-urlencoded", b"text/plain") and body.lstrip()[:1] == b"{"


async def _refuse(exc: ConveyorError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error_response(exc)
    response.headers["Connection"] = "close"  # the unread rest of the body makes the connection unusable
    await response(scope, receive, send)
