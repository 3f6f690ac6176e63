"""Helpers for the server tests: a real server in a background thread on a free loopback port, /metrics.

Each server is the one `conveyor serve --no-core-process` builds (`build_server`), bound to port 0, so a
test can reach into its engine core; test_core_process.py covers the core in its own process. Engines are small
(64 MiB of KV cache, two threads) so the whole suite stays within a few minutes on two cores.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.config import EngineConfig, ServerConfig
from conveyor.engine.core_client import ThreadCoreClient
from conveyor.front.llm_engine import LLMEngine
from conveyor.server.api_server import ConveyorServer, build_server

API_KEY = "test-key-123"
SMALL_ENGINE = dict(threads=2, kv_cache_memory="64MiB", max_num_batched_tokens=512)


@dataclass
class RunningServer:
    server: ConveyorServer
    thread: threading.Thread
    engine: LLMEngine

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "server thread did not stop"


def start_server(model: Path | None, *, api_key: str | None = None, max_waiting_requests: int | None = None,
                 shutdown_grace_s: float = 2.0, max_body_bytes: int = 1024 * 1024,
                 server_options: dict[str, Any] | None = None, **engine_options: Any) -> RunningServer:
    """`server_options`: further ServerConfig fields."""
    options = {**SMALL_ENGINE, **engine_options}
    engine = LLMEngine(EngineConfig.from_options(model=str(model) if model is not None else None, **options))
    server = build_server(ThreadCoreClient(engine.core), engine.tokenizer, engine.model_name, server=ServerConfig(**{
        "host": "127.0.0.1", "port": 0, "api_key": api_key, "max_waiting_requests": max_waiting_requests,
        "shutdown_grace_s": shutdown_grace_s, "max_body_bytes": max_body_bytes, "core_process": False,
        **(server_options or {})}))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "server thread died while starting"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return RunningServer(server, thread, engine)

def metrics(base_url: str) -> dict[str, float]:
    """/metrics as {sample name (labels dropped, summed over them): value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def slow_steps(engine: LLMEngine, seconds: float) -> Iterator[list[set[str]]]:
    """Make every step take at least `seconds`; yields the request ids of each step as it runs."""
    runner = engine.runner
    original = runner.execute
    steps: list[set[str]] = []

    def execute(plan: Any) -> Any:
        steps.append({row.request_id for row in plan.rows})
        time.sleep(seconds)
        return original(plan)

    runner.execute = execute  # type: ignore[method-assign]
    try:
        yield steps
    finally:
        del runner.execute  # back to the class's method


def sse_events(lines: list[str]) -> list[dict | str]:
    """The `data:` payloads of an event stream, JSON-decoded except the final [DONE]."""
    import json

    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def child_pids(pid: int) -> list[int]:
    """Live (not zombie) children of a process, from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def is_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def core_pid(server_pid: int) -> int:
    """The engine core process of a `conveyor serve` process (not multiprocessing's resource tracker)."""
    for pid in child_pids(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine core process under {server_pid}: {child_pids(server_pid)}")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_server_process(model: Path, *flags: str) -> tuple[Any, str]:
    """`python -m conveyor serve` on a free loopback port, once /health says 200: (Popen, base URL).

    The server leads a process group of its own, so a test can signal the group as a terminal does.
    """
    import os
    import subprocess
    import sys
    import tempfile

    port = free_port()
    # The log goes to a file, not a pipe: a server that logs more than a pipe holds (64 KiB) before the test
    # reads it would block in its logging, and the test would hang instead of failing.
    with tempfile.NamedTemporaryFile("w", prefix="conveyor-serve-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "serve", "--model", str(model), "--port", str(port), "--threads",
             "1", "--kv-cache-memory", "64MiB", *flags],
            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    process.stdout = open(log.name)   # read from its start, as the pipe was  # noqa: SIM115
    os.unlink(log.name)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read() if process.stdout else "server exited")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("server did not come up")
        time.sleep(0.1)
