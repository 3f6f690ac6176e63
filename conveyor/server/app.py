"""FastAPI app factory: the OpenAI-compatible HTTP surface over one AsyncEngine.

Owns routing and the exception handlers: every ConveyorError, validation error and HTTP error
is rendered by `error_response` (request_guard.py, which also owns the key, body and concurrency checks).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.config import ServerConfig
from conveyor.front.async_engine import AsyncEngine, EngineDeadError
from conveyor.front.core_watchdog import CoreWatchdog
from conveyor.errors import ConveyorError, InvalidRequest, ModelNotFound
from conveyor.server.batch.api import BatchRunner, add_batch_routes
from conveyor.server.batch.store import BatchStore
from conveyor.server.live_view import add_dashboard
from conveyor.server.llamacpp.serving import add_llamacpp_routes
from conveyor.server.metrics import ServerMetrics
from conveyor.server.openai_api.openai_serving import OpenAIServing
from conveyor.server.http.request_guard import RequestGuard, error_response
from conveyor.server.openai_api.request_schemas import ChatCompletionRequest, CompletionRequest
from conveyor.server.openai_responses.store import ResponseStore
from conveyor.server.openai_responses.api import add_responses_routes
from conveyor.server.openai_api.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from conveyor.server.prompt_cache.slots import add_slot_routes
from conveyor.server.openai_api.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request: malformed JSON, an invalid field (named in `param`), or prompt plus "
              "max_tokens over the model length (code `context_length_exceeded`)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (408, "the request body did not arrive within the server's body timeout"),
        (413, "request body too large (code `request_too_large`), or prompt text over the server's "
              "character limit (code `prompt_too_long`)"),
        (429, "waiting queue full; retry after the `Retry-After` header's seconds"),
        (500, "the engine step running this request failed"),
        (503, "the server is shutting down, or its engine core died or made no progress for "
              "--core-stall-timeout, or it has --max-concurrency requests in progress (code `server_busy`, "
              "with `Retry-After`)"),
    )
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}
# Before OpenAPI 3.2 an event stream's `schema` describes each event.
_STREAM_DOC = {"text/event-stream": {
    "schema": {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "description": "a JSON chunk, a JSON error body, or [DONE] last"},
        "event": {"type": "string"}}},
    "example": 'data: {"id": "...", "choices": [...]}\n\ndata: [DONE]\n\n'}}


def build_app(async_engine: AsyncEngine, model_name: str, server: ServerConfig) -> FastAPI:
    """The app serves `model_name` as `server` says (its host, port and connection timeouts are
    uvicorn's); its lifespan starts the core client and stops it at the end.

    The API key guards /v1/*, /tokenize, /detokenize, /slots/* and the live view's stream (and /metrics with
    `protect_metrics`); /health stays open. `enable_docs` False removes /openapi.json and /docs;
    `enable_dashboard` False removes the live view (/ and /dashboard*).
    """
    api_key = server.api_key
    metrics = ServerMetrics(async_engine, model_name, stats_log_interval_s=server.stats_log_interval_s)
    async_engine.observers.append(metrics.observe)
    serving = OpenAIServing(async_engine, model_name, server.max_prompt_chars, server.grammar,
                            server.reasoning_parser, server.tool_call_parser)
    created = int(time.time())

    watchdog = CoreWatchdog(async_engine, server.core_stall_timeout_s)
    batch_store = BatchStore(None if server.state_dir is None else Path(server.state_dir))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        watchdog.start()
        runner = app.state.batch_runner = BatchRunner(batch_store, app, async_engine.info.scheduler.max_num_seqs,
                                                      api_key)
        runner.start()
        yield
        await runner.stop()             # lines in flight stay pending: a restart runs them
        await watchdog.stop()
        await async_engine.shutdown(0)  # in-flight requests were drained before lifespan shutdown

    # The docs page is served with Swagger UI's own files (swagger-ui-bundle), not FastAPI's CDN links,
    # so it works on a machine without internet; ReDoc has no such package and is left out.
    app = FastAPI(title="conveyor", summary="OpenAI-compatible LLM server built around continuous batching",
                  version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  **({} if server.enable_docs else {"openapi_url": None}))
    if server.enable_docs:
        add_offline_docs(app)
    app.state.metrics = metrics
    app.state.live_view = None
    if server.enable_dashboard:
        app.state.live_view = add_dashboard(app, async_engine, model_name, {
            "api_key_required": api_key is not None, "max_waiting_requests": server.max_waiting_requests,
            "max_concurrency": server.max_concurrency})
    app.state.engine = async_engine
    app.state.serving = serving
    app.add_middleware(RequestGuard, server=server)

    @app.exception_handler(ConveyorError)
    async def _conveyor_error(request: Request, exc: ConveyorError) -> JSONResponse:
        if exc.status >= 500:
            logger.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_invalid_request(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ConveyorError(str(exc.detail))
        error.status = exc.status_code
        error.error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = error_response(error)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s raised", request.method, request.url.path, exc_info=exc)
        return error_response(ConveyorError(f"internal server error: {type(exc).__name__}"))

    add_batch_routes(app, batch_store)
    responses_path = server.responses_store or (server.state_dir and str(Path(server.state_dir) / "responses.sqlite3"))
    add_responses_routes(app, serving, ResponseStore(Path(responses_path) if responses_path else None))
    add_llamacpp_routes(app, serving, async_engine.info.scheduler.max_num_seqs)

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["openai"],
              responses={200: {"content": _STREAM_DOC, "description": "a completion, or SSE chunks when "
                                                                       "`stream` is true"}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI's Completions API; `prompt` may be a batch (one choice per prompt, same batch)."""
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"],
              responses={200: {"content": _STREAM_DOC, "description": "a chat completion, or SSE chunks "
                                                                       "when `stream` is true"}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI's Chat Completions API, with the model's own chat template."""
        return await serving.chat(body, request)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"], responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created,
                                         max_model_len=async_engine.info.max_model_len)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["openai"],
             responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return ModelCard(id=model_name, created=created, max_model_len=async_engine.info.max_model_len)

    @app.post("/v1/embeddings", include_in_schema=False)   # not an operation: it only says why not
    async def embeddings() -> Any:
        """Not served: the model is a text generator, and pooled hidden states of one are poor embeddings."""
        raise ModelNotFound(f"{model_name!r} is a text-generation model; this server has no embeddings "
                            f"endpoint (use /v1/completions or /v1/chat/completions)")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize_text(body: TokenizeRequest) -> TokenizeResponse:
        """The prompt's (or the chat messages') token ids, as a completion would run them."""
        return await tokenize(serving, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize_tokens(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids (special tokens included)."""
        return await detokenize(serving, body)

    add_slot_routes(app, async_engine, _ERRORS)

    @app.get("/health", response_model=HealthResponse, responses={503: _ERRORS[503]})
    async def health() -> Any:
        if async_engine.dead_reason is not None:
            return error_response(EngineDeadError(async_engine.dead_reason))
        if not async_engine.is_accepting:
            return error_response(EngineDeadError("the server is shutting down"))
        if async_engine.stall_reason is not None:
            return error_response(EngineDeadError(async_engine.stall_reason))
        return HealthResponse()

    @app.get("/metrics", response_class=Response,
             responses={401: _ERRORS[401], 200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def add_offline_docs(app: FastAPI) -> None:
    """/docs: Swagger UI from the swagger-ui-bundle package's files, under /docs/static."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from starlette.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount("/docs/static", StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="conveyor - Swagger UI",
                                   swagger_js_url="/docs/static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/static/swagger-ui.css",
                                   swagger_favicon_url="/docs/static/favicon-32x32.png")


def _invalid_request(exc: RequestValidationError) -> InvalidRequest:
    """Pydantic's first complaint -> a 400 naming the field (`messages.0.role`), as OpenAI does."""
    errors = exc.errors()
    if not errors:
        return InvalidRequest("invalid request body")
    # Of a union's complaints, one about the value (a lone surrogate) says more than "not a string".
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return InvalidRequest(f"the request body is not valid JSON: {reason}".rstrip(": "))
    path: list[str] = []
    for part in first.get("loc", ())[1:] if first.get("loc", ("",))[0] == "body" else first.get("loc", ()):
        if isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS):
            break  # a union member's tag, such as 'list[int]', not a field
        path.append(str(part))
    param = ".".join(path) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing" and param is None:
        message = "the request body is missing"
    elif param is None:
        message = f"the request body must be a JSON object sent as 'Content-Type: application/json' ({message})"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return InvalidRequest(f"{param}: {message}{more}" if param else f"{message}{more}", param=param)
