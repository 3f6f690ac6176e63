"""How the front reaches an EngineCore: the `CoreClient` interface, the busy loop, the thread and inline clients.

Every client hands the core the same commands (`handle`) and gets the same `StepOutputs` per step
(`step_or_fail`). `ThreadCoreClient` runs `run_busy_loop` on a thread of this process (tests that reach
into the core use it); `ProcessCoreClient` (core_process.py) runs it in a process of its own, which is
what `conveyor serve` does, so the model never competes with HTTP and text work for the GIL.
`InlineCoreClient` is the offline face's: the core in the caller's thread, stepped when the caller asks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from conveyor.engine.messages import CoreCommand, CoreInfo, Shutdown, StepOutputs

if TYPE_CHECKING:   # a front whose core runs in its own process never imports torch
    from conveyor.engine.core import EngineCore

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5   # how long an idle core blocks for a command before it checks on its front

OutputsHandler = Callable[[StepOutputs], None]
DeathHandler = Callable[[str], None]


class CoreClient(Protocol):
    """The front's handle on a core. `start` and `send` run on the event loop; handlers are called there."""

    info: CoreInfo

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler, on_death: DeathHandler) -> None: ...

    def send(self, command: CoreCommand) -> StepOutputs | None:
        """Queue a command; None: what the core owes for it comes with a later message, to `on_outputs`."""
        ...

    async def close(self) -> None:
        """Stop the core once nothing is in flight; returns when it is gone."""
        ...

    def kill(self) -> None:
        """Make sure the core is gone, whatever state it is in (after `close`, or instead of it)."""
        ...


def run_busy_loop(core: EngineCore, receive: Callable[[float], list[CoreCommand] | None],
                  send: OutputsHandler) -> None:
    """Drain commands, step, send: until `receive` returns None or a SHUTDOWN arrives.

    `receive(timeout_s)` returns the commands that arrived within timeout_s (none is fine); it
    waits only when the core has nothing to run, so a busy core never sleeps.
    """
    # What exists now (the model, the tokenizer, the engine) outlives the loop: the collector's full
    # passes need not walk it (~6 ms a step at 256 rows). Thawed at the end, so nothing stays pinned.
    gc.freeze()
    try:
        while True:
            commands = receive(0.0 if core.has_unfinished_requests() else IDLE_WAIT_S)
            if commands is None:
                return
            for command in commands:
                if isinstance(command, Shutdown):
                    return
                core.handle(command)
            has_news = core.has_news()
            if core.has_unfinished_requests() or has_news:
                outputs = core.step_or_fail()
                if has_news or outputs.step is not None or outputs.deltas:   # an empty plan owes nothing
                    send(outputs)
    finally:
        gc.unfreeze()
        core.close()


class ThreadCoreClient:
    """The core on a background thread of this process; outputs reach the loop by call_soon_threadsafe."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = core.info
        self._commands: queue.SimpleQueue[CoreCommand] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler, on_death: DeathHandler) -> None:
        def send(outputs: StepOutputs) -> None:
            loop.call_soon_threadsafe(on_outputs, outputs)

        def run() -> None:
            try:
                run_busy_loop(self.core, self._receive, send)
            except BaseException as exc:  # the thread is the core: its end must reach the front
                logger.exception("engine core thread failed")
                loop.call_soon_threadsafe(on_death, f"the engine core failed: {exc}")

        self._thread = threading.Thread(target=run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout_s: float) -> list[CoreCommand]:
        commands = []
        try:
            commands.append(self._commands.get(timeout=timeout_s) if timeout_s else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def send(self, command: CoreCommand) -> None:
        self._commands.put(command)

    async def close(self) -> None:
        self._commands.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def kill(self) -> None:
        """Nothing to kill: the core thread is a daemon and ends with `close` or with the process."""


class InlineCoreClient:
    """The core in the caller's thread, for the offline face: no thread, no pickling, no waiting.

    A command is applied as it is sent, and `send` returns what the core owes the front for it at once
    (a refused add; the last delta, with its figures, of a request ended from outside), which the busy
    loop would send with its next message; `step` runs one step and returns its message.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = core.info

    def send(self, command: CoreCommand) -> StepOutputs:
        self.core.handle(command)
        return self.core.take_news()

    def step(self) -> StepOutputs:
        return self.core.step_or_fail()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()
