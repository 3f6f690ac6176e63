"""AsyncEngine: the server's front over one engine core; each request gets its own asyncio stream.

Runs on the event loop only. Its `Front` (shared with the offline LLMEngine) admits, starts, aborts
and tracks requests through a `CoreClient` and turns each `StepOutputs` into text deltas (stop strings
included); here are the server's own parts: the waiting-queue bound, per-tenant caps, one output stream
per request, the stall watchdog's bookkeeping. If the core dies, every request in flight fails at once
with a 503 and the engine refuses new ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from conveyor.engine.core_client import CoreClient
from conveyor.front.front import Front, Rejected
from conveyor.engine.messages import CoreLoad, RequestOutput, StepOutputs, WatchBatch
from conveyor.front.output_processor import OutputProcessor
from conveyor.front.output_stream import OutputStream
from conveyor.engine.structured_output import GrammarCompiler
from conveyor.text.tokenizer import Tokenizer
from conveyor.errors import ConveyorError, QueueFull
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StepObserver = Callable[[StepOutputs], None]


class EngineDeadError(ConveyorError):
    status = 503
    error_type = "service_unavailable"


class AsyncEngine:
    def __init__(self, client: CoreClient, tokenizer: Tokenizer, max_waiting_requests: int | None = None,
                 clock: Callable[[], float] = time.monotonic, max_requests_per_tenant: int | None = None) -> None:
        self.client = client
        self.info = client.info
        self.tokenizer = tokenizer
        self.front = Front(tokenizer, self.info, client.send)
        self.max_waiting_requests = max_waiting_requests
        self.clock = clock
        self.observers: list[StepObserver] = []
        self.death_observers: list[Callable[[str], None]] = []
        self.load = CoreLoad(0, 0, 0, 0.0)      # as of the core's last message
        self._queues: dict[str, OutputStream] = {}
        self.max_requests_per_tenant = max_requests_per_tenant
        self._tenant_of: dict[str, str] = {}     # request id -> tenant, for requests in flight
        self._batch_ids: set[str] = set()         # requests in flight that batch jobs sent (no limits)
        self.tenant_in_flight: dict[str, int] = {}
        self._num_in_transit = 0                # adds sent that the core has not reported yet
        self._started = False
        self.is_accepting = True
        self.dead_reason: str | None = None
        # For the stall watchdog: requests the core still owes output, and when it last showed progress.
        self._owed: set[str] = set()
        self.last_progress_s = clock()
        self.stall_reason: str | None = None
        self.last_prompt_token_ids: list[int] | None = None   # what llama.cpp's /slots save names

    @property
    def grammars(self) -> GrammarCompiler:
        return self.front.grammars

    @property
    def processor(self) -> OutputProcessor:
        return self.front.processor

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the core client on the running loop; a second call does nothing."""
        if self._started:
            return
        self._started = True
        self.client.start(asyncio.get_running_loop(), self._on_outputs, self._on_death)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        return self.load.num_waiting + self._num_in_transit

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting; let in-flight requests finish for up to grace_s, fail the rest, stop the core."""
        self.is_accepting = False
        deadline = time.monotonic() + grace_s
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._queues:
            self.front.abort(list(self._queues))
            self._fail_all(EngineDeadError("the server is shutting down"))
        if self._started and self.dead_reason is None:
            self._started = False
            await self.client.close()

    # ------------------------------------------------------------ requests

    def num_would_wait(self, num_new: int) -> int:
        """Requests that would wait for a batch slot if `num_new` more arrived now.

        The core's last load still counts requests that finished or were aborted since; the
        front's own open requests do not, so the smaller of the two is the fresher count.
        """
        reported = self.load.num_running + self.load.num_waiting + self._num_in_transit
        # Batch requests yield their slots to interactive ones (they run at the lowest priority).
        in_core = max(0, min(reported, len(self._queues)) - len(self._batch_ids))
        return max(0, in_core + num_new - self.info.scheduler.max_num_seqs)

    def add(self, prompts: list[list[int]], params: SamplingParams, request_ids: list[str],
            priority: int = 0, tenant: str = "", is_batch: bool = False,
            on_ready: Callable[[str], None] | None = None) -> list[OutputStream]:
        """Admit and start a request's prompts in one synchronous block, so no other request can pass
        the same capacity check in between: raise for a request that could never run (400), past the
        waiting-queue bound (429), or while not accepting (503); else send them to the core and
        return one output stream per prompt, for `outputs`. A batch job's request (`is_batch`) skips
        the waiting-queue and per-tenant bounds and is counted in neither: it yields to interactive ones.
        `on_ready(request_id)`: called when a request's stream goes from empty to holding output, for a
        caller that takes from many streams (then it calls `forget` or `abort` for each itself)."""
        arrival_s = self.clock()
        core_requests = [self.front.make_request(request_id, prompt_token_ids, params, arrival_s, priority, tenant,
                                                 is_batch)
                         for request_id, prompt_token_ids in zip(request_ids, prompts, strict=True)]
        self._check_accepting()
        limit = None if is_batch else self.max_waiting_requests
        if limit is not None and self.num_would_wait(len(prompts)) > limit:
            raise QueueFull(f"the server is at capacity ({limit} requests may wait for a batch slot); retry later")
        per_tenant = None if is_batch else self.max_requests_per_tenant
        in_flight = self.tenant_in_flight.get(tenant, 0)
        if per_tenant is not None and in_flight + len(prompts) > per_tenant:
            raise QueueFull(f"tenant {tenant or '(default)'!r} has {in_flight} requests in flight and may have "
                            f"{per_tenant} (--max-requests-per-tenant); retry later")
        queues: list[OutputStream] = []
        for request in core_requests:
            request_id = request.request_id
            queue = OutputStream(None if on_ready is None else lambda rid=request_id: on_ready(rid))
            self._queues[request_id] = queue
            if is_batch:
                self._batch_ids.add(request.request_id)
            else:
                self._tenant_of[request.request_id] = tenant
                self.tenant_in_flight[tenant] = self.tenant_in_flight.get(tenant, 0) + 1
            queues.append(queue)
        if not self._owed:   # the core was idle: its silence so far was no stall
            self.last_progress_s = self.clock()
        self._owed.update(request.request_id for request in core_requests)
        self._num_in_transit += len(core_requests)
        self._reject(self.front.start(core_requests))
        self.last_prompt_token_ids = list(prompts[-1])
        return queues

    def _check_accepting(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.stall_reason is not None:
            raise EngineDeadError(self.stall_reason)
        if not self.is_accepting:
            raise EngineDeadError("the server is shutting down")

    async def outputs(self, request_id: str, queue: OutputStream) -> AsyncIterator[RequestOutput]:
        """Stream one started request's outputs. Leaving the iteration early (a client gone) aborts it."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.forget(request_id)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0, tenant: str = "") -> AsyncIterator[RequestOutput]:
        """`add` and `outputs` for one prompt."""
        request_id = request_id or uuid.uuid4().hex
        [queue] = self.add([prompt_token_ids], params, [request_id], priority, tenant)
        async for output in self.outputs(request_id, queue):
            yield output

    def forget(self, request_id: str) -> None:
        """The request's last output was taken: it no longer counts as in flight."""
        self._queues.pop(request_id, None)
        self._batch_ids.discard(request_id)
        tenant = self._tenant_of.pop(request_id, None)
        if tenant is not None:
            left = self.tenant_in_flight[tenant] - 1
            if left:
                self.tenant_in_flight[tenant] = left
            else:
                del self.tenant_in_flight[tenant]

    def abort(self, request_id: str) -> None:
        self.forget(request_id)
        self._owed.discard(request_id)
        if self.dead_reason is None:
            self.front.abort([request_id])
        else:
            self.front.drop(request_id)

    def watch_batch(self, interval_s: float | None) -> None:
        """Have the core attach a BatchSnapshot to its messages at most every interval_s (None: stop)."""
        if self._started and self.dead_reason is None:
            self.client.send(WatchBatch(interval_s))

    # ------------------------------------------------------------ from the core (on the event loop)

    def _on_outputs(self, outputs: StepOutputs) -> None:
        self.load = outputs.load
        self.last_progress_s = self.clock()
        if self.stall_reason is not None:
            logger.warning("the engine core is stepping again; accepting requests")
            self.stall_reason = None
        self._num_in_transit -= outputs.num_added
        text_outputs, rejected = self.front.process(outputs)
        self._reject(rejected)
        for output in text_outputs:
            if output.finished:
                self._owed.discard(output.request_id)
            self._put(output.request_id, output)
        for observer in self.observers:
            try:
                observer(outputs)
            except Exception:  # metrics must never stop the stream of outputs
                logger.exception("step observer failed")

    def _reject(self, rejected: Rejected) -> None:
        """Adds the core refused: each one's stream ends with the core's error."""
        for request_id, exc in rejected:
            self._owed.discard(request_id)
            self._put(request_id, exc)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put(item)

    def _on_death(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("%s; failing %d requests in flight", reason, len(self._queues))
        self.dead_reason = reason
        self.is_accepting = False
        self._fail_all(EngineDeadError(reason))
        for observer in self.death_observers:
            observer(reason)

    @property
    def num_owed(self) -> int:
        """Requests sent to the core that it has not finished, rejected or been told to abort."""
        return len(self._owed)

    def mark_stalled(self, reason: str) -> None:
        """The core has shown no progress for too long: fail what is in flight, refuse new requests
        (and /health) with `reason` until its next message."""
        if self.stall_reason is not None or self.dead_reason is not None:
            return
        logger.error("%s; failing %d requests in flight", reason, len(self._queues))
        self.stall_reason = reason
        if self._queues:
            self.front.abort(list(self._queues))
        self._fail_all(EngineDeadError(f"{reason}; this request was stopped"))

    def _fail_all(self, exc: ConveyorError) -> None:
        for request_id, queue in list(self._queues.items()):
            self.front.drop(request_id)
            queue.put(exc)
        self._queues.clear()
        self._owed.clear()
        self._tenant_of.clear()
        self.tenant_in_flight.clear()
