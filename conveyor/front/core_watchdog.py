"""The front's watchdog over a core that stops stepping without dying.

A core process that is stopped (SIGSTOP, a debugger), swapped out or stuck in a step stays alive,
so the death check (its pipe, its exit) never fires, and every request waits forever while /health
says 200. Here the front looks every interval: if the core owes requests output and has sent
nothing for `stall_timeout_s`, the engine is marked stalled (AsyncEngine.mark_stalled): requests
in flight fail with a 503, new ones and /health get a 503. The core's next message clears it, so a
core that was only paused serves again without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from conveyor.front.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

_MAX_CHECK_INTERVAL_S = 1.0


class CoreWatchdog:
    def __init__(self, engine: AsyncEngine, stall_timeout_s: float, clock: Callable[[], float] | None = None) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock or engine.clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching on the running loop; a timeout of 0 watches nothing."""
        if self.stall_timeout_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="conveyor-core-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def check(self) -> None:
        engine = self.engine
        if engine.stall_reason is not None or engine.dead_reason is not None or not engine.num_owed:
            return
        silent_s = self.clock() - engine.last_progress_s
        if silent_s > self.stall_timeout_s:
            engine.mark_stalled(f"the engine core has made no progress for {silent_s:.0f} s with {engine.num_owed} "
                                f"requests waiting on it")

    async def _run(self) -> None:
        interval_s = min(_MAX_CHECK_INTERVAL_S, self.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.check()
