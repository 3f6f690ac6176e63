"""Disconnect soak: hundreds of streams, half closed mid-stream. Afterwards no KV block is in use,
nothing is in flight, and file descriptors and threads are back to where they started.
`python -m bench soak` runs the longer version against a `conveyor serve` process."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, sse_events, start_server, wait_for


@pytest.fixture(scope="module")
def soak_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=16)
    yield running
    running.stop()


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def stream(http: httpx.AsyncClient, i: int, disconnect: bool) -> str:
    body = {"prompt": f"soak client {i}", "max_tokens": 24, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"status {response.status_code}"
        lines = []
        async for line in response.aiter_lines():
            lines.append(line)
            if disconnect and line.startswith("data: "):
                return "disconnected"       # leaving the block closes the connection mid-stream
    events = sse_events(lines)
    if events[-1] != "[DONE]" or any("error" in e for e in events if isinstance(e, dict)):
        return f"bad stream: {events[-2:]}"
    return "completed"


def soak(server: RunningServer, num_streams: int, concurrency: int = 48) -> Counter:
    async def run() -> Counter:
        gate = asyncio.Semaphore(concurrency)

        async def one(http: httpx.AsyncClient, i: int) -> str:
            async with gate:
                return await stream(http, i, disconnect=i % 2 == 1)

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            return Counter(await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(num_streams))), 600))

    return asyncio.run(run())


def check_soak(server: RunningServer, num_streams: int) -> None:
    engine = server.engine
    soak(server, 4)                                  # warm-up: threads and pools that stay for good
    wait_for(lambda: engine.blocks.num_used_blocks == 0, 10, "the warm-up to drain")
    fds_before, threads_before = num_fds(), threading.active_count()

    outcomes = soak(server, num_streams)
    assert outcomes == Counter(completed=num_streams - num_streams // 2, disconnected=num_streams // 2), outcomes
    wait_for(lambda: not engine.has_unfinished_requests() and engine.blocks.num_used_blocks == 0, 20,
             "every stream to finish or be aborted, and its KV blocks freed")
    assert server.server.async_engine.num_in_flight == 0
    wait_for(lambda: num_fds() <= fds_before, 20, f"file descriptors back to {fds_before}")
    wait_for(lambda: threading.active_count() <= threads_before, 20, f"threads back to {threads_before}")


def test_disconnect_soak(soak_server: RunningServer) -> None:
    check_soak(soak_server, 200)


@pytest.mark.slow
def test_disconnect_soak_long(soak_server: RunningServer) -> None:
    check_soak(soak_server, 2000)
