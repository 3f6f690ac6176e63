"""`run_server`: EngineConfig -> LLMEngine -> AsyncEngine -> app -> uvicorn, with a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops accepting connections, lets in-flight requests finish for
up to `shutdown_grace_s`, fails whatever is still running with a clear 503 error (an error event
when streaming), closes the connections and exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
from types import FrameType

import uvicorn

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine import LLMEngine
from conveyor.server.app import DEFAULT_MAX_BODY_BYTES, build_app

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_GRACE_S = 30.0
_CONNECTION_CLOSE_S = 5.0   # after the engine stopped, every response is complete; this only bounds stragglers


class ConveyorServer(uvicorn.Server):
    """uvicorn, with the engine's grace period first in its shutdown.

    uvicorn waits for open connections before it runs the app's lifespan shutdown, so a request
    still generating would hold the exit up indefinitely. Here the engine ends every request
    (finished, or failed after the grace period) before uvicorn starts waiting.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_grace_s: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_grace_s = shutdown_grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in getattr(self, "servers", []):
            server.close()  # stop accepting now, not after the grace period
        logger.info("shutting down: %d requests in flight, up to %.1f s to finish", self.async_engine.num_in_flight,
                    self.shutdown_grace_s)
        await self.async_engine.shutdown(self.shutdown_grace_s)
        await super().shutdown(sockets=sockets)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); valid once started."""
        return self.servers[0].sockets[0].getsockname()[1]


def build_server(engine: LLMEngine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_waiting_requests: int | None = None, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ConveyorServer:
    if shutdown_grace_s < 0:
        raise ValueError(f"shutdown_grace_s must be >= 0, got {shutdown_grace_s!r}")
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
    app = build_app(async_engine, engine.model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    # log_config=None: uvicorn's loggers propagate to the handlers cli.py configured.
    config = uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=int(_CONNECTION_CLOSE_S))
    return ConveyorServer(config, async_engine, shutdown_grace_s)


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               max_waiting_requests: int | None = None, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> int:
    """Load the model and serve until SIGTERM or Ctrl-C; returns the exit code (0 after a clean shutdown).

    max_waiting_requests defaults to the scheduler config's; the bound is applied at the door (429)
    rather than inside the scheduler, so a request that was admitted is never refused mid-stream.
    """
    if max_waiting_requests is None:
        max_waiting_requests = config.scheduler.max_waiting_requests
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_waiting_requests=None))
    engine = LLMEngine(config)
    server = build_server(engine, host=host, port=port, api_key=api_key, max_waiting_requests=max_waiting_requests,
                          shutdown_grace_s=shutdown_grace_s, max_body_bytes=max_body_bytes)
    # uvicorn re-raises a caught signal once it has shut down, under the handler it found at start;
    # the defaults would end the process with -SIGTERM or KeyboardInterrupt instead of a clean exit 0.
    previous = {sig: signal.signal(sig, _after_graceful_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _after_graceful_shutdown(signum: int, frame: FrameType | None) -> None:
    logger.info("stopped by signal %d", signum)
