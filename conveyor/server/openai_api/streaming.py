"""One HTTP request's engine requests, and their end when the client goes away.

`PromptGroup` runs every prompt of a request as its own `AsyncEngine.generate` call (so a batch
prompt joins the same continuous batch) and merges their outputs, tagged with the choice index,
into one stream. Closing the group cancels its tasks; each task's generator then aborts its engine
request, which the engine thread applies before its next step. `until_disconnected` and
`EventStreamResponse` close the group when the client disconnects, with or without streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.front.async_engine import AsyncEngine, OutputQueue
from conveyor.front.front import Choices
from conveyor.engine.messages import RequestOutput
from conveyor.errors import ConveyorError
from conveyor.sampling_params import SamplingParams
from conveyor.server.openai_api.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed its connection before its response was ready."""


class PromptGroup:
    """The engine requests of one HTTP request: choice k has request id `{group_id}-{k}`.

    With n choices per prompt, choice k is prompt k // n's (k % n)-th, as OpenAI numbers them. Creating
    the group admits and starts the first choice of every prompt (`AsyncEngine.add`), so a refusal
    (400, 429, 503) is raised here, before any response starts. A prompt's other choices start when
    its first one has its first token (`Choices`, as offline); a start refused then (the server
    filled up meanwhile) ends those choices with that error.
    """

    def __init__(self, engine: AsyncEngine, group_id: str, prompt_token_ids: list[list[int]],
                 params: SamplingParams, priority: int = 0, tenant: str = "", is_batch: bool = False) -> None:
        self.group_id = group_id
        self.n = n = params.n
        self.num_prompts = len(prompt_token_ids) * n       # choices: what the response lists
        self._engine = engine
        self._prompts = prompt_token_ids
        self._priority, self._tenant, self._is_batch = priority, tenant, is_batch
        self._request_ids = [f"{group_id}-{index}" for index in range(self.num_prompts)]
        self._outputs: asyncio.Queue[tuple[int, RequestOutput | ConveyorError]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._choices = [Choices(params, stagger=True) for _ in prompt_token_ids]
        firsts = [i * n for i in range(len(prompt_token_ids))]
        # Every prompt's first choice in one add: the request is admitted whole or not at all.
        self._start(firsts, engine.add(prompt_token_ids, params.for_choice(0), [self._request_ids[k] for k in firsts],
                                       priority, tenant, is_batch))

    def _start(self, indexes: list[int], queues: list[OutputQueue]) -> None:
        self._tasks += [asyncio.create_task(self._pump(index, queue), name=self._request_ids[index])
                        for index, queue in zip(indexes, queues)]

    def _start_siblings(self, first: int) -> None:
        """The choices of the prompt whose first choice is `first` that waited for its first output."""
        later = self._choices[first // self.n].start_after_first_output()
        if self._closed or not later:
            return
        siblings = [first + j for j, _ in later]
        prompt = self._prompts[first // self.n]
        try:
            for j, params in later:
                self._start([first + j], self._engine.add([prompt], params, [self._request_ids[first + j]],
                                                          self._priority, self._tenant, self._is_batch))
        except ConveyorError as exc:
            started = {task.get_name() for task in self._tasks}
            for index in siblings:
                if self._request_ids[index] not in started:
                    self._outputs.put_nowait((index, exc))

    async def _pump(self, index: int, queue: OutputQueue) -> None:
        request_id = self._request_ids[index]
        try:
            async with contextlib.aclosing(self._engine.outputs(request_id, queue)) as outputs:
                async for output in outputs:
                    if self.n > 1 and index % self.n == 0:
                        self._start_siblings(index)
                    self._outputs.put_nowait((index, output))
        except ConveyorError as exc:
            self._outputs.put_nowait((index, exc))
        except Exception as exc:  # a bug here must reach the client as an error, not leave it waiting
            logger.exception("request %s failed outside the engine", request_id)
            self._outputs.put_nowait((index, ConveyorError(f"internal error: {exc}")))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) in arrival order until every prompt finished.

        Raises the first error: a ConveyorError from the engine, or a failed step's error (500).
        """
        num_open = self.num_prompts
        while num_open:
            index, item = await self._outputs.get()
            if isinstance(item, ConveyorError):
                raise item
            if item.error is not None:
                raise ConveyorError(item.error)
            if item.finished:
                num_open -= 1
                if item.finish_reason not in ("stop", "length"):
                    raise ConveyorError(f"request {item.request_id} ended with {item.finish_reason}")
            yield index, item

    async def wait_first_choices(self) -> bool:
        """Wait until each prompt's first choice has ended; False if one was aborted."""
        results = await asyncio.gather(*self._tasks[:len(self._prompts)], return_exceptions=True)
        return all(result is None for result in results)

    def close(self) -> None:
        """Abort whatever has not finished: each cancelled task's generator sends its abort."""
        self._closed = True
        unfinished = [task for task in self._tasks if not task.done()]
        if unfinished:
            logger.info("aborting %d of the %d requests of %s: the response ended before they finished",
                        len(unfinished), self.num_prompts, self.group_id)
        for task in unfinished:
            task.cancel()
            # A task cancelled before it first ran never reaches its generator's abort.
            self._engine.abort(task.get_name())


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
    return f"data: {payload.translate(_LINE_BREAKS)}\n\n"


def error_payload(exc: ConveyorError) -> str:
    return ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param,
                                         code=exc.code)).model_dump_json()


def error_event(exc: ConveyorError) -> str:
    """A mid-stream error, in the shape OpenAI's clients raise as an APIError."""
    return sse(error_payload(exc))

