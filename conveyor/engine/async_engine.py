"""AsyncEngine: one background thread steps the engine; each request gets its own asyncio stream.

The event loop never touches the engine: it sends commands (add, abort) through a thread-safe
queue that the engine thread drains before every step, and receives outputs through
`call_soon_threadsafe`. So an abort takes effect before the next step, and a slow step never
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from conveyor.engine.engine import LLMEngine, RequestOutput
from conveyor.engine.stats import StepStats
from conveyor.errors import ConveyorError, QueueFull
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StepObserver = Callable[[StepStats | None, list[RequestOutput]], None]


class EngineDeadError(ConveyorError):
    status = 503
    error_type = "service_unavailable"


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_s: float
    sink: Callable[[RequestOutput | BaseException], None]


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._num_pending_adds = 0          # sent to the engine thread, not yet added
        self._lock = threading.Lock()       # guards _num_pending_adds
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.is_accepting = True

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread; a second call does nothing."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="conveyor-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks) + self._num_pending_adds

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting; let in-flight requests finish for up to grace_s, then fail the rest."""
        self.is_accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True
        self._commands.put(None)
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # ------------------------------------------------------------ requests

    def check_capacity(self, num_new: int = 1) -> None:
        """Raise QueueFull if admitting num_new more requests would pass the waiting-queue bound."""
        if not self.is_accepting:
            raise EngineDeadError("the server is shutting down")
        limit = self.max_waiting_requests
        if limit is not None and self.engine.scheduler.num_waiting + self._num_pending_adds + num_new > limit:
            raise QueueFull(f"the server is at capacity ({limit} requests waiting); retry later")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the engine's own error now, in the caller, for a request that could never run."""
        self.engine.encode_prompt(prompt_token_ids)
        self.engine.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Leaving the iteration early (a client gone) aborts it."""
        request_id = request_id or uuid.uuid4().hex
        self.validate(prompt_token_ids, params)
        self.check_capacity()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        with self._lock:
            self._num_pending_adds += 1
        self._sinks[request_id] = sink
        self._send(_Add(request_id, prompt_token_ids, params, priority, self.engine.clock(), sink))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_commands()
            if self._stopping:
                break
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug outside the model run: fail what is in flight, keep serving
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            if self.observer is not None:
                try:
                    self.observer(engine.last_step, outputs)
                except Exception:  # metrics must never stop the engine
                    logger.exception("step observer failed")
            for output in outputs:
                sink = self._sinks.get(output.request_id)
                if sink is not None:
                    sink(output)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None:
                continue
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            with self._lock:
                self._num_pending_adds -= 1
            if command.request_id not in self._sinks:
                continue  # its client left before it was added
            try:
                self.engine.add_request(command.prompt_token_ids, command.params, request_id=command.request_id,
                                        priority=command.priority, arrival_s=command.arrival_s)
            except ConveyorError as exc:
                command.sink(exc)
            except Exception as exc:  # a bug in admission fails this request, not the engine thread
                logger.exception("adding request %s failed", command.request_id)
                command.sink(ConveyorError(f"internal error while adding the request: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)
        for sink in list(self._sinks.values()):
            sink(exc if isinstance(exc, ConveyorError) else EngineDeadError(f"engine error: {exc}"))
