"""OpenAI's Files and Batches API: upload a JSONL file, run it as a batch job in the spare capacity.

A batch's lines go through the server's own OpenAI app in process (httpx's ASGI transport), at
BATCH_PRIORITY: after every interactive request, which preempts them when the batch is full. A
line's result is committed to the BatchStore as it finishes, so a restarted server (same
--state-dir) resumes its batches with the lines still pending. A line the server could not take
for now (429, 503: full or shutting down) stays pending and is retried.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, File, Form, UploadFile
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from conveyor.errors import InvalidRequest, NotFound
from conveyor.server.batch_store import BatchStore, PendingLine
from conveyor.server.batch_format import BATCH_URLS, BatchLine, result_line

logger = logging.getLogger(__name__)

T = TypeVar("T")
BATCH_PRIORITY = 2**31          # below every interactive request that keeps the default priority 0
_RETRY_S = 1.0                  # after a 429 / 503, before the line is tried again
_RETRIED = (429, 503)


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

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://batch",
                                     headers=self.headers, timeout=None) as client:
            while True:
                batch = self.store.next_active()
                if batch is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                try:
                    await self._run_batch(client, batch)
                except asyncio.CancelledError:
                    raise
                except Exception:   # a bug must not stop the other batches forever
                    logger.exception("batch %s failed", batch["id"])
                    self.store.finalize(batch["id"], "failed")

    async def _run_batch(self, client: Any, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        if batch["status"] == "validating":
            self.store.set_status(batch_id, "in_progress")
        limit = asyncio.Semaphore(self.concurrency)

        async def one(line: PendingLine) -> None:
            async with limit:
                while self.store.status(batch_id) == "in_progress":
                    body = {**line.body, "priority": BATCH_PRIORITY}
                    response = await client.post(line.url, json=body)
                    if response.status_code in _RETRIED:
                        await asyncio.sleep(_RETRY_S)
                        continue
                    result = result_line(BatchLine(line.number, line.custom_id), response.status_code,
                                         response.json(), None)
                    self.store.finish_line(batch_id, line.number, response.status_code < 400, result)
                    return

        await asyncio.gather(*(one(line) for line in self.store.pending(batch_id)))
        if self.store.status(batch_id) == "cancelling":
            self.store.finalize(batch_id, "cancelled")
        else:
            self.store.set_status(batch_id, "finalizing")
            self.store.finalize(batch_id, "completed")
        logger.info("batch %s %s: %s", batch_id, self.store.batch(batch_id)["status"],
                    self.store.batch(batch_id)["request_counts"])


def _found(value: T | None, kind: str, ident: str, param: str | None = None) -> T:
    if value is None:
        raise NotFound(f"no {kind} {ident!r}", param=param or f"{kind}_id")
    return value


def add_batch_routes(app: FastAPI, store: BatchStore) -> None:
    """/v1/files and /v1/batches; the runner is app.state.batch_runner (started with the app)."""

    @app.post("/v1/files", tags=["batch"])
    async def upload_file(file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        """Upload a JSONL file of batch requests (purpose `batch`)."""
        if purpose != "batch":
            raise InvalidRequest("purpose must be 'batch': files are only used as batch input", param="purpose")
        return store.add_file(file.filename or "upload.jsonl", purpose, await file.read())

    @app.get("/v1/files", tags=["batch"])
    async def list_files() -> dict[str, Any]:
        return {"object": "list", "data": store.files()}

    @app.get("/v1/files/{file_id}", tags=["batch"])
    async def get_file(file_id: str) -> dict[str, Any]:
        return _found(store.file(file_id), "file", file_id)

    @app.get("/v1/files/{file_id}/content", tags=["batch"])
    async def file_content(file_id: str) -> Response:
        return Response(_found(store.file_content(file_id), "file", file_id), media_type="application/jsonl")

    @app.post("/v1/batches", tags=["batch"])
    async def create_batch(body: CreateBatch) -> dict[str, Any]:
        """Run an uploaded file's requests at a priority below interactive ones; results in output_file_id."""
        if body.endpoint not in BATCH_URLS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(BATCH_URLS)}", param="endpoint")
        _found(store.file(body.input_file_id), "file", body.input_file_id, param="input_file_id")
        batch = store.add_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
        app.state.batch_runner.wake()
        return batch

    @app.get("/v1/batches", tags=["batch"])
    async def list_batches() -> dict[str, Any]:
        return {"object": "list", "data": store.batches()}

    @app.get("/v1/batches/{batch_id}", tags=["batch"])
    async def get_batch(batch_id: str) -> dict[str, Any]:
        return _found(store.batch(batch_id), "batch", batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", tags=["batch"])
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        """Lines not started stay unanswered; lines in flight finish; the partial output is kept."""
        found = _found(store.batch(batch_id), "batch", batch_id)
        if found["status"] in ("validating", "in_progress"):
            store.set_status(batch_id, "cancelling")
            app.state.batch_runner.wake()
        return store.batch(batch_id)   # type: ignore[return-value]
