"""OpenAI's Files and Batches API: upload a JSONL file, run it as a batch job in the spare capacity.

A batch's lines go through the server's own OpenAI app in process (httpx's ASGI transport), marked
in the ASGI scope as batch work (BATCH_SCOPE_KEY, which no HTTP client can set): they run at
BATCH_PRIORITY, after every interactive request, which preempts them when the batch is full, and
they count toward none of the interactive limits (--max-concurrency, the waiting queue, the
per-tenant cap). A line's result is committed to the BatchStore as it finishes, so a restarted
server (same --state-dir) resumes its batches with the lines still pending. No line starts while
interactive requests wait for a batch slot. A line the server could not take for now (429, 503:
full or shutting down) stays pending and is retried. A batch whose results cannot be stored (a
full disk) is marked failed with the reason, and the runner goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, TypeVar

from fastapi import FastAPI, File, Form, Request, UploadFile
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from conveyor.errors import ConveyorError, InvalidRequest, NotFound
from conveyor.server.batch.format import BATCH_URLS, BatchLine, result_line
from conveyor.server.batch.store import BatchStore, PendingLine

logger = logging.getLogger(__name__)

T = TypeVar("T")
BATCH_PRIORITY = 2**31          # below every interactive request that keeps the default priority 0
BATCH_SCOPE_KEY = "conveyor.batch"
_TENANT_HEADER = "x-tenant"
_RETRY_S = 1.0                  # after a 429 / 503, before the line is tried again
_ERROR_RETRY_S = 1.0            # after the store itself failed, before the runner looks again
_RETRIED = (429, 503)
_YIELD_S = 0.05                 # how often a line waiting for interactive requests to be served looks again


def is_batch_request(scope: Scope) -> bool:
    """True for a batch line the runner sent in process; never for a request from the network."""
    return bool(scope.get(BATCH_SCOPE_KEY))


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class BatchRunner:
    """Runs active batches one at a time, `concurrency` lines in flight, until stopped."""

    def __init__(self, store: BatchStore, app: FastAPI, concurrency: int, api_key: str | None) -> None:
        self.store, self.app, self.concurrency = store, app, concurrency
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="conveyor-batches")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    async def _marked(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app({**scope, BATCH_SCOPE_KEY: True}, receive, send)

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self._marked), base_url="http://batch",
                                     headers=self.headers, timeout=None) as client:
            while True:
                try:
                    batch = self.store.next_active()
                except Exception:   # the store unreadable for now: look again later, never stop
                    logger.exception("reading the batch store failed")
                    await asyncio.sleep(_ERROR_RETRY_S)
                    continue
                if batch is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                try:
                    await self._run_batch(client, batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:   # a full disk or a bug must not stop the other batches
                    cause = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
                    reason = cause.message if isinstance(cause, ConveyorError) else f"internal error: {cause!r}"
                    logger.exception("batch %s failed", batch["id"])
                    self.store.fail(batch["id"], reason)

    async def _run_batch(self, client: Any, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        if batch["status"] == "validating":
            self.store.set_status(batch_id, "in_progress")
        tenant = self.store.tenant(batch_id)
        headers = {_TENANT_HEADER: tenant} if tenant else {}
        queue = deque(await asyncio.to_thread(self.store.pending, batch_id))

        async def worker() -> None:
            while queue and self.store.status(batch_id) == "in_progress":
                await self._run_line(client, batch_id, queue.popleft(), headers)

        async with asyncio.TaskGroup() as group:   # one line failing to store cancels the rest
            for _ in range(min(self.concurrency, len(queue))):
                group.create_task(worker())
        if self.store.status(batch_id) == "cancelling":
            await asyncio.to_thread(self.store.finalize, batch_id, "cancelled")
        else:
            self.store.set_status(batch_id, "finalizing")
            await asyncio.to_thread(self.store.finalize, batch_id, "completed")
        logger.info("batch %s %s: %s", batch_id, self.store.status(batch_id),
                    self.store.batch(batch_id)["request_counts"])   # type: ignore[index]

    async def _run_line(self, client: Any, batch_id: str, line: PendingLine, headers: dict[str, str]) -> None:
        engine = self.app.state.engine
        while self.store.status(batch_id) == "in_progress":
            if engine.num_would_wait(0) > 0:   # interactive requests wait for a slot: no new line now
                await asyncio.sleep(_YIELD_S)
                continue
            body = {**line.body, "priority": BATCH_PRIORITY}
            response = await client.post(line.url, json=body, headers=headers)
            if response.status_code in _RETRIED:
                await asyncio.sleep(_RETRY_S)
                continue
            try:
                body: Any = response.json()
            except ValueError:   # not JSON: kept as text, the line still gets its result
                body = response.text
            result = result_line(BatchLine(line.number, line.custom_id), response.status_code, body, None)
            self.store.finish_line(batch_id, line.number, response.status_code < 400, result)
            return


def _found(value: T | None, kind: str, ident: str, param: str | None = None) -> T:
    if value is None:
        raise NotFound(f"no {kind} {ident!r}", param=param or f"{kind}_id")
    return value


def _tenant(request: Request) -> str:
    """Whose files and batches: the X-Tenant header, as for completions ("" without one)."""
    return request.headers.get(_TENANT_HEADER) or ""


def add_batch_routes(app: FastAPI, store: BatchStore) -> None:
    """/v1/files and /v1/batches; the runner is app.state.batch_runner (started with the app)."""
    app.state.batch_store = store

    @app.post("/v1/files", tags=["batch"])
    async def upload_file(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        """Upload a JSONL file of batch requests (purpose `batch`)."""
        if purpose != "batch":
            raise InvalidRequest("purpose must be 'batch': files are only used as batch input", param="purpose")
        content = await file.read()
        return await asyncio.to_thread(store.add_file, file.filename or "upload.jsonl", purpose, content,
                                       _tenant(request))

    @app.get("/v1/files", tags=["batch"])
    async def list_files(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": store.files(_tenant(request))}

    @app.get("/v1/files/{file_id}", tags=["batch"])
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        return _found(store.file(file_id, _tenant(request)), "file", file_id)

    @app.get("/v1/files/{file_id}/content", tags=["batch"])
    async def file_content(file_id: str, request: Request) -> Response:
        content = await asyncio.to_thread(store.file_content, file_id, _tenant(request))
        return Response(_found(content, "file", file_id), media_type="application/jsonl")

    @app.post("/v1/batches", tags=["batch"])
    async def create_batch(body: CreateBatch, request: Request) -> dict[str, Any]:
        """Run an uploaded file's requests at a priority below interactive ones; results in output_file_id."""
        if body.endpoint not in BATCH_URLS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(BATCH_URLS)}", param="endpoint")
        tenant = _tenant(request)
        _found(store.file(body.input_file_id, tenant), "file", body.input_file_id, param="input_file_id")
        # Splitting and checking a big file takes a while: off the event loop.
        batch = await asyncio.to_thread(store.add_batch, body.input_file_id, body.endpoint, body.completion_window,
                                        body.metadata, tenant)
        app.state.batch_runner.wake()
        return batch

    @app.get("/v1/batches", tags=["batch"])
    async def list_batches(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": store.batches(_tenant(request))}

    @app.get("/v1/batches/{batch_id}", tags=["batch"])
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        return _found(store.batch(batch_id, _tenant(request)), "batch", batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", tags=["batch"])
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        """Lines not started stay unanswered; lines in flight finish; the partial output is kept."""
        found = _found(store.batch(batch_id, _tenant(request)), "batch", batch_id)
        if found["status"] in ("validating", "in_progress"):
            store.set_status(batch_id, "cancelling")
            app.state.batch_runner.wake()
        return store.batch(batch_id)   # type: ignore[return-value]
