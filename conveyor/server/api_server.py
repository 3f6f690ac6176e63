"""`run_server`: EngineConfig + ServerConfig -> engine core, AsyncEngine front, app, uvicorn.

By default the engine core runs in a process of its own (core_process.py) and this process keeps
HTTP, tokenization and detokenization. On SIGTERM (or Ctrl-C) the server answers 503 to /health
and to new requests, lets in-flight requests finish for up to the grace period, fails whatever is
still running with a clear 503 error (an error event when streaming), stops the core and exits 0. If the
core dies, every request in flight fails at once with a 503, /health turns 503, and the server
exits 1: a supervisor restarts the whole server, which is simpler to reason about than a core
restarted under live connections whose KV state is gone.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from conveyor.config import EngineConfig, ServerConfig
from conveyor.front.async_engine import AsyncEngine
from conveyor.engine.core_client import CoreClient, ThreadCoreClient
from conveyor.engine.core_process import ProcessCoreClient
from conveyor.text.tokenizer import Tokenizer
from conveyor.text.tokenizer_loader import load_tokenizer
from conveyor.model.checkpoint import default_model_name, resolve_model_path
from conveyor.server.app import build_app
from conveyor.server.http.header_timeout import header_timeout_protocol
from conveyor.server.live_view import LiveView

logger = logging.getLogger(__name__)

_CONNECTION_CLOSE_S = 5.0   # after the engine stopped, every response is complete; this only bounds stragglers
_DEAD_CORE_EXIT_DELAY_S = 1.0  # /health answers 503 this long before the port closes, for load balancers to see


class _HealthyProbesFilter(logging.Filter):
    """Drops uvicorn's access line of a 200 from /health: load balancers probe it every few seconds.

    A failing probe (503 while shutting down or after the core died) is still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:   # (client, method, path, http version, status)
            path, status = str(args[2]).split("?", 1)[0], args[4]
            return not (path == "/health" and status == 200)
        return True


_HEALTHY_PROBES = _HealthyProbesFilter()


class ConveyorServer(uvicorn.Server):
    """uvicorn, with the engine's grace period first in its shutdown, and an exit code.

    uvicorn waits for open connections before it runs the app's lifespan shutdown, so a request
    still generating would hold the exit up indefinitely. Here the engine ends every request
    (finished, or failed after the grace period) before uvicorn starts waiting.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_grace_s: float,
                 live_view: LiveView | None = None, model_name: str = "", startup_began_s: float | None = None) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.async_engine = async_engine
        self.live_view = live_view
        self.shutdown_grace_s = shutdown_grace_s
        self.startup_began_s = startup_began_s   # perf_counter when loading began, for the ready line
        self.exit_code = 0
        async_engine.death_observers.append(self._core_died)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            began = self.startup_began_s
            logger.info("start-up: ready, serving %s on http://%s:%d%s", self.model_name,
                        self.config.host, self.port,
                        "" if began is None else f", {time.perf_counter() - began:.2f} s after start-up began")

    def _core_died(self, reason: str) -> None:
        self.exit_code = 1
        asyncio.get_running_loop().call_later(_DEAD_CORE_EXIT_DELAY_S, setattr, self, "should_exit", True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The listening socket stays open through the grace period: /health and new requests get a
        # 503 there (load balancers and clients see why), not a refused connection.
        logger.info("shutting down: %d requests in flight, up to %.1f s to finish", self.async_engine.num_in_flight,
                    self.shutdown_grace_s)
        await self.async_engine.shutdown(self.shutdown_grace_s)
        if self.live_view is not None:   # its streams never end by themselves; viewers saw the drain
            self.live_view.close()
        await super().shutdown(sockets=sockets)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); valid once started."""
        return self.servers[0].sockets[0].getsockname()[1]


def build_app_over(client: CoreClient, tokenizer: Tokenizer, model_name: str,
                   server: ServerConfig = ServerConfig()) -> tuple[AsyncEngine, FastAPI]:
    """The AsyncEngine front over a core client, and the app that serves it (without uvicorn)."""
    async_engine = AsyncEngine(client, tokenizer, max_waiting_requests=server.max_waiting_requests,
                               max_requests_per_tenant=server.max_requests_per_tenant)
    app = build_app(async_engine, model_name, server)
    return async_engine, app


def build_server(client: CoreClient, tokenizer: Tokenizer, model_name: str, server: ServerConfig = ServerConfig(),
                 startup_began_s: float | None = None) -> ConveyorServer:
    """A uvicorn server over a core client (an in-process core: `ThreadCoreClient(engine.core)`)."""
    async_engine, app = build_app_over(client, tokenizer, model_name, server)
    # log_config=None: uvicorn's loggers propagate to the handlers cli.py configured.
    access = logging.getLogger("uvicorn.access")
    if _HEALTHY_PROBES not in access.filters:
        access.addFilter(_HEALTHY_PROBES)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=int(_CONNECTION_CLOSE_S),
                            http=header_timeout_protocol(server.header_timeout_s),
                            timeout_keep_alive=server.keep_alive_timeout_s)
    return ConveyorServer(config, async_engine, server.shutdown_grace_s, app.state.live_view, model_name,
                          startup_began_s)


def start_core(config: EngineConfig, server: ServerConfig = ServerConfig(),
               started: ProcessCoreClient | None = None) -> tuple[CoreClient, Tokenizer, str]:
    """Load the model into a core (its own process with `server.core_process`, else a thread's) and
    return its client, the tokenizer and the served model name; the caller kills the client at the end.
    `started`: a core process already started with `config` (`conveyor serve` starts it
    before importing the server, so the two processes' imports overlap).
    """
    if not server.core_process:
        # Imported here: a front with a core process never imports torch.
        from conveyor.front.llm_engine import LLMEngine

        engine = LLMEngine(config)
        return ThreadCoreClient(engine.core), engine.tokenizer, engine.model_name
    model_path = resolve_model_path(config.model.model)
    client = started or ProcessCoreClient(config, logging.getLogger().getEffectiveLevel())
    try:
        tokenizer = load_tokenizer(model_path, config.model.chat_template)   # while the core loads the weights
        client.wait_ready()
    except BaseException:
        client.kill()
        raise
    return client, tokenizer, config.model.served_model_name or default_model_name(model_path)


def run_server(config: EngineConfig, server: ServerConfig = ServerConfig(),
               started: ProcessCoreClient | None = None, began: float | None = None) -> int:
    """Load the model and serve until SIGTERM or Ctrl-C; returns the exit code (0 after a clean shutdown).
    `started`: see `start_core`; `began`: when start-up began (perf_counter), for the ready line."""
    began = time.perf_counter() if began is None else began
    client, tokenizer, model_name = start_core(config, server, started)
    try:
        return _run(build_server(client, tokenizer, model_name, server, began))
    finally:
        client.kill()   # a no-op after a clean shutdown; never leave the core behind


def _run(uvicorn_server: ConveyorServer) -> int:
    # uvicorn re-raises a caught signal once it has shut down, under the handler it found at start;
    # the defaults would end the process with -SIGTERM or KeyboardInterrupt instead of a clean exit 0.
    previous = {sig: signal.signal(sig, _after_graceful_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn_server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return uvicorn_server.exit_code


def _after_graceful_shutdown(signum: int, frame: FrameType | None) -> None:
    logger.info("stopped by signal %d", signum)
