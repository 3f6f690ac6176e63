"""Overload: a burst far past the waiting queue. Each request either completes or gets a real 429
(with Retry-After) before its first byte; none is lost, none hangs, no KV block stays in use."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, slow_steps, sse_events, start_server, wait_for

NUM_CLIENTS = 200


@pytest.fixture(scope="module")
def small_queue_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=4, max_waiting_requests=8)
    yield running
    running.stop()


async def one_stream(http: httpx.AsyncClient, i: int) -> str:
    body = {"prompt": f"client {i}", "max_tokens": 4, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert (await response.aread()) and response.headers["content-type"] == "application/json"
            return "429"
        assert response.status_code == 200, await response.aread()
        events = sse_events([line async for line in response.aiter_lines()])
    assert events[-1] == "[DONE]", events[-3:]
    assert all("error" not in e for e in events[:-1] if isinstance(e, dict)), events
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    return "completed"


def test_burst_of_streams_each_completes_or_gets_429(small_queue_server: RunningServer) -> None:
    async def burst() -> list[str]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=small_queue_server.base_url, timeout=120, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one_stream(http, i) for i in range(NUM_CLIENTS))), 300)

    with slow_steps(small_queue_server.engine, 0.005):   # steps long enough for a real queue to form
        outcomes = Counter(asyncio.run(burst()))
    assert outcomes["completed"] + outcomes["429"] == NUM_CLIENTS, outcomes
    assert outcomes["429"] > 0 and outcomes["completed"] >= 4 + 8, outcomes
    engine = small_queue_server.engine
    wait_for(lambda: not engine.has_unfinished_requests() and engine.blocks.num_used_blocks == 0, 10,
             "the engine to drain")
    assert small_queue_server.server.async_engine.num_in_flight == 0


def test_no_queue_accepts_what_can_start_now(tiny_checkpoint: Path) -> None:
    """max_waiting_requests 0: an idle server serves; past the free batch slots, 429."""
    running = start_server(tiny_checkpoint, max_num_seqs=2, max_waiting_requests=0)
    try:
        url = f"{running.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200

        async def three_at_once() -> list[str]:
            async with httpx.AsyncClient(base_url=running.base_url, timeout=120) as http:
                return await asyncio.gather(*(one_stream(http, i) for i in range(3)))

        with slow_steps(running.engine, 0.05):
            outcomes = sorted(asyncio.run(three_at_once()))
        assert outcomes == ["429", "completed", "completed"]
    finally:
        running.stop()
