"""One HTTP request's engine requests: `PromptGroup` runs every prompt (and every choice of it) as its own
engine request in the running batch and merges their outputs, tagged with the choice index, into one stream
that one consumer reads. Closing the group aborts what has not finished; the responses in streaming.py close
it however they end.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

from conveyor.engine.messages import RequestOutput
from conveyor.errors import ConveyorError
from conveyor.front.async_engine import AsyncEngine
from conveyor.front.front import Choices
from conveyor.front.output_stream import OutputStream, Wakeup
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PromptGroup:
    """The engine requests of one HTTP request: choice k has request id `{group_id}-{k}`.

    With n choices per prompt, choice k is prompt k // n's (k % n)-th, as OpenAI numbers them. Creating
    the group admits and starts the first choice of every prompt (`AsyncEngine.add`), so a refusal
    (400, 429, 503) is raised here, before any response starts. A prompt's other choices start when
    its first one has its first token (`Choices`, as offline); a start refused then (the server
    filled up meanwhile) ends those choices with that error.

    No task runs per choice: each choice's `OutputStream` tells the group when it has output, and the
    one consumer of `outputs` takes it, everything that arrived since it last looked merged into one.
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
        self._index_of = {request_id: index for index, request_id in enumerate(self._request_ids)}
        self._streams: dict[int, OutputStream] = {}          # started choices
        self._open: set[int] = set()                          # started choices whose end was not taken
        self._ready: deque[int] = deque()                     # choices with output, in the order it came
        self._wakeup = Wakeup()
        loop = asyncio.get_running_loop()
        self._first_ended = [loop.create_future() for _ in prompt_token_ids]   # True: finished, False: not
        self._closed = False
        self._choices = [Choices(params, stagger=True) for _ in prompt_token_ids]
        firsts = [i * n for i in range(len(prompt_token_ids))]
        # Every prompt's first choice in one add: the request is admitted whole or not at all.
        self._start(firsts, engine.add(prompt_token_ids, params.for_choice(0), [self._request_ids[k] for k in firsts],
                                       priority, tenant, is_batch, self._on_ready))

    def _start(self, indexes: list[int], streams: list[OutputStream]) -> None:
        for index, stream in zip(indexes, streams, strict=True):
            self._streams[index] = stream
            self._open.add(index)

    def _on_ready(self, request_id: str) -> None:
        self._ready.append(self._index_of[request_id])
        self._wakeup.set()

    def _start_siblings(self, first: int) -> None:
        """The choices of the prompt whose first choice is `first` that waited for its first output."""
        later = self._choices[first // self.n].start_after_first_output()
        if self._closed or not later:
            return
        prompt = self._prompts[first // self.n]
        try:
            for j, params in later:
                self._start([first + j], self._engine.add([prompt], params, [self._request_ids[first + j]],
                                                          self._priority, self._tenant, self._is_batch,
                                                          self._on_ready))
        except ConveyorError as exc:
            for j, _ in later:
                if first + j not in self._streams:
                    stream = self._streams[first + j] = OutputStream(
                        lambda request_id=self._request_ids[first + j]: self._on_ready(request_id))
                    self._open.add(first + j)
                    stream.put(exc)

    def _ended(self, index: int, finished: bool) -> None:
        self._open.discard(index)
        self._engine.forget(self._request_ids[index])
        if index % self.n == 0 and not self._first_ended[index // self.n].done():
            self._first_ended[index // self.n].set_result(finished)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) in arrival order until every prompt finished.

        Raises the first error: a ConveyorError from the engine, or a failed step's error (500).
        """
        num_open = self.num_prompts
        while num_open:
            while not self._ready:
                await self._wakeup.wait()
            index = self._ready.popleft()
            for item in self._streams[index].take():
                if isinstance(item, BaseException):
                    self._ended(index, False)
                    raise item if isinstance(item, ConveyorError) else ConveyorError(f"internal error: {item}")
                if self.n > 1 and index % self.n == 0:
                    self._start_siblings(index)
                if item.finished:
                    self._ended(index, item.error is None and item.finish_reason in ("stop", "length"))
                if item.error is not None:
                    raise ConveyorError(item.error)
                if item.finished:
                    num_open -= 1
                    if item.finish_reason not in ("stop", "length"):
                        raise ConveyorError(f"request {item.request_id} ended with {item.finish_reason}")
                yield index, item

    async def wait_first_choices(self) -> bool:
        """Wait until each prompt's first choice has ended; False if one was aborted or failed."""
        return all(await asyncio.gather(*self._first_ended))

    def close(self) -> None:
        """Abort whatever has not finished; forget what finished but was not taken."""
        self._closed = True
        unfinished = [index for index in self._open if not self._streams[index].has_ended]
        if unfinished:
            logger.info("aborting %d of the %d requests of %s: the response ended before they finished",
                        len(unfinished), self.num_prompts, self.group_id)
        for index in sorted(self._open):
            request_id = self._request_ids[index]
            if self._streams[index].has_ended:
                self._engine.forget(request_id)
            else:
                self._engine.abort(request_id)
        self._open.clear()
        for ended in self._first_ended:
            if not ended.done():
                ended.set_result(False)
