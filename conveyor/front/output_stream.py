"""OutputStream: one request's outputs that its consumer has not taken yet, merged as they wait.

The core steps at its own pace and the front hands every step's outputs to each request at once. A
consumer (an HTTP response) that falls behind takes all the steps it missed as one output: one
wake-up, one chunk, one write, instead of a queue that grows by one item per token and a front that
never catches up. A consumer that keeps up sees one output per step, as before. Text, tokens and
logprobs concatenate in order, so what a client receives is the same; only the chunking differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from conveyor.engine.messages import RequestOutput

Item = RequestOutput | BaseException   # an exception ends the request


def merge_into(pending: RequestOutput, later: RequestOutput) -> None:
    """Append `later` (the same request's next output) to `pending`, which nobody has taken yet; `steps`
    keeps where each step's text and tokens lie, for readers that count per step (reasoning tokens)."""
    pending.steps = _steps(pending) + _steps(later)
    pending.new_token_ids = pending.new_token_ids + later.new_token_ids
    pending.new_text += later.new_text
    if later.new_logprobs:
        pending.new_logprobs = pending.new_logprobs + later.new_logprobs
    if pending.prompt_logprobs is None:
        pending.prompt_logprobs = later.prompt_logprobs
    pending.finished = later.finished
    pending.finish_reason = later.finish_reason
    pending.stop_reason = later.stop_reason
    pending.error = later.error
    pending.metrics = later.metrics
    pending.prompt_token_ids = later.prompt_token_ids


def _steps(output: RequestOutput) -> list[tuple[int, int]]:
    return output.steps if output.steps is not None else [(len(output.new_text), len(output.new_token_ids))]


class Wakeup:
    """One waiter at a time on the event loop, woken by `set` (a no-op while nobody waits)."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def set(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        finally:
            self._future = None


class OutputStream:
    """Runs on the event loop only. `on_ready` (if given) is called when the stream goes from empty to
    holding something; otherwise a consumer awaits `get`."""

    __slots__ = ("_items", "_wakeup", "_on_ready", "has_ended")

    def __init__(self, on_ready: Callable[[], None] | None = None) -> None:
        self._items: list[Item] = []
        self._wakeup = Wakeup()
        self._on_ready = on_ready
        self.has_ended = False     # its last output (finished, or an exception) has been put

    def put(self, item: Item) -> None:
        items = self._items
        if isinstance(item, BaseException) or item.finished:
            self.has_ended = True
        if items:
            last = items[-1]
            if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
                merge_into(last, item)
            else:
                items.append(item)
            return
        items.append(item)
        if self._on_ready is not None:
            self._on_ready()
        else:
            self._wakeup.set()

    def take(self) -> list[Item]:
        """Everything waiting, oldest first (at most one output, then at most one exception)."""
        items, self._items = self._items, []
        return items

    async def get(self) -> Item:
        """The next item: everything that arrived since the last one, merged."""
        while not self._items:
            await self._wakeup.wait()
        return self._items.pop(0)
