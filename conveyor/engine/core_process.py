"""The engine core in a process of its own, and the front's `ProcessCoreClient` for it.

Transport: one multiprocessing pipe (a Unix socket pair) carrying pickled slotted dataclasses from
messages.py; one message per step from the core, one per command from the front. Measured
against pyzmq on the same messages (scripts/measure_transport.py) the round trip is the same,
within noise, and dominated by pickling; the pipe needs no dependency and, unlike ZeroMQ, no I/O
thread in the core. The process is started with 'spawn', since forking a process that has
loaded torch is unsafe.

The core ignores SIGINT and SIGTERM: the front owns shutdown (a Ctrl-C reaches the whole process
group) and stops the core with a SHUTDOWN command, killing it only if it does not exit. The core
exits by itself when its front goes away (its pipe closes or its parent changes).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import threading
import time
from multiprocessing.connection import Connection

from conveyor.config import EngineConfig
from conveyor.engine.core_client import DeathHandler, OutputsHandler, run_busy_loop
from conveyor.engine.messages import CoreCommand, CoreInfo, Shutdown
from conveyor.errors import ModelLoadError
from conveyor.logging_setup import configure_logging   # a spawned process starts with no logging set up

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0   # for the core to leave its busy loop after SHUTDOWN (it finishes the step it is in)


def run_core_process(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The core process's entry point: load, report `CoreInfo` (or the start-up error), then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(logging.getLevelName(log_level), "WARNING")
    parent_pid = os.getppid()
    # torch comes in here, in the core process only: the front can start this process before it
    # imports anything heavy of its own, and the two import at once.
    from conveyor.engine.core import EngineCore
    from conveyor.runtime.tensor_parallel import WorkerLost

    try:
        core = EngineCore(config)
    except BaseException as exc:  # the front re-raises it, as if it had loaded the model itself
        try:
            conn.send(_picklable(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass   # the front already gave up (it found the error itself): it has said why
        raise SystemExit(1) from None

    # One poll object for the process: Connection.poll builds and tears down a selector at every
    # call, and a busy core asks once per step whether a command came.
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)

    def receive(timeout_s: float) -> list[CoreCommand] | None:
        try:
            if not poller.poll(timeout_s * 1000):
                return None if os.getppid() != parent_pid else []
            commands = [conn.recv()]
            while poller.poll(0):
                commands.append(conn.recv())
            return commands
        except (EOFError, OSError):   # the front is gone
            return None

    conn.send(core.info)
    try:
        run_busy_loop(core, receive, conn.send)
    except (BrokenPipeError, ConnectionResetError):
        logger.info("the front went away; engine core exiting")
    except WorkerLost as exc:   # the front sees the exit and fails every request in flight
        logger.error("engine core stopping: %s", exc)
        conn.close()
        logging.shutdown()
        os._exit(1)
    # The front waits for this exit; the interpreter's teardown of torch would only delay it.
    conn.close()
    logging.shutdown()
    os._exit(0)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ModelLoadError(f"{type(exc).__name__}: {exc}")


class ProcessCoreClient:
    """Starts the core process; `wait_ready` blocks until it is ready (or raises its start-up error)."""

    def __init__(self, config: EngineConfig, log_level: int = logging.WARNING) -> None:
        started = time.perf_counter()
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(target=run_core_process, args=(config, child_conn, log_level),
                                       name="conveyor-core", daemon=True)
        self.process.start()
        child_conn.close()   # so the front sees EOF when the core dies
        self._closing = False
        self._dead = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OutputsHandler | None = None
        self._on_death: DeathHandler | None = None
        self._outbox: queue.SimpleQueue[CoreCommand | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._poller: select.poll | None = None
        self._started_s = started
        self.info: CoreInfo | None = None

    def wait_ready(self) -> CoreInfo:
        """Block until the core has loaded the model; on a start-up error, reap the process and raise it."""
        try:
            self.info = self._wait_ready()
        except BaseException:
            self.kill()
            raise
        logger.info("engine core process %d ready %.2f s after spawn (%.2f s loading the model and KV cache, "
                    "the rest starting Python and importing torch); %d torch threads", self.process.pid,
                    time.perf_counter() - self._started_s, self.info.startup_s, self.info.num_threads)
        return self.info

    def _wait_ready(self) -> CoreInfo:
        while not self._conn.poll(0.1):
            if not self.process.is_alive():
                raise ModelLoadError(f"the engine core process exited during start-up "
                                     f"(exit code {self.process.exitcode})")
        message = self._conn.recv()
        if isinstance(message, BaseException):
            raise message
        if not isinstance(message, CoreInfo):
            raise ModelLoadError(f"the engine core process sent {type(message).__name__} instead of its info")
        return message

    # ------------------------------------------------------------ CoreClient

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler, on_death: DeathHandler) -> None:
        self._loop, self._on_outputs, self._on_death = loop, on_outputs, on_death
        loop.add_reader(self._conn.fileno(), self._read)
        loop.add_reader(self.process.sentinel, self._died)
        # uvloop's add_reader makes the pipe non-blocking, and then a message larger than what has
        # arrived (a batch snapshot) fails mid-recv with EAGAIN, and a full pipe fails a send: both
        # read as the core's death. Readiness is all the loop needs; the reads and writes block.
        os.set_blocking(self._conn.fileno(), True)
        # One poll object: Connection.poll builds a selector at every call, and a message comes every step.
        self._poller = select.poll()
        self._poller.register(self._conn.fileno(), select.POLLIN)
        # Sends go through a thread: a full pipe (a core busy in a long step) must never block the loop.
        self._sender = threading.Thread(target=self._send_loop, name="conveyor-core-sender", daemon=True)
        self._sender.start()

    def send(self, command: CoreCommand) -> None:
        if not self._dead:
            self._outbox.put(command)

    async def close(self) -> None:
        self._closing = True
        self._stop_reading()
        if not self._dead and self.process.is_alive():
            self._outbox.put(Shutdown())
        self._outbox.put(None)
        await asyncio.to_thread(self.process.join, _STOP_TIMEOUT_S)
        self.kill()
        logger.info("engine core process stopped (exit code %s)", self.process.exitcode)

    def kill(self) -> None:
        """Make sure the core process is gone (it ignores SIGTERM, so SIGKILL)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self._conn.close()

    # ------------------------------------------------------------ internals

    def _send_loop(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except OSError:   # the core died; the sentinel reports it
                return

    def _read(self) -> None:
        try:
            while self._poller.poll(0):
                outputs = self._conn.recv()
                assert self._on_outputs is not None
                self._on_outputs(outputs)
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        if self._dead or self._closing:
            return
        self._dead = True
        try:   # what the core sent before it died still counts
            while self._conn.poll():
                assert self._on_outputs is not None
                self._on_outputs(self._conn.recv())
        except (EOFError, OSError):
            pass
        self._stop_reading()
        self.process.join(1)
        self._outbox.put(None)
        code = self.process.exitcode
        reason = (f"the engine core process died (killed by signal {-code})" if code is not None and code < 0
                  else f"the engine core process died (exit code {code})")
        assert self._on_death is not None
        self._on_death(reason)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
            self._loop.remove_reader(self.process.sentinel)
