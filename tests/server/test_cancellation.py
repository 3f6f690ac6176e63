"""A client that goes away has its requests aborted and their KV blocks freed, streaming or not."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from server_helpers import RunningServer, metrics, slow_steps, wait_for

LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


def idle(server: RunningServer) -> bool:
    values = metrics(server.base_url)
    return (values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
            and values["vllm:kv_cache_usage_perc"] == 0.0)


@pytest.fixture(autouse=True)
def starts_idle(tiny_server: RunningServer) -> None:
    wait_for(lambda: idle(tiny_server), 10, "the server to be idle before the test")


def test_streaming_disconnect_aborts(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    before = metrics(base)
    with slow_steps(tiny_server.engine, 0.01) as steps:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=30,
                          json={"prompt": "the quick brown fox", "stream": True, **LONG}) as response:
            lines = response.iter_lines()
            for _ in range(3):
                while not next(lines).startswith("data: "):
                    pass
            during = metrics(base)
            assert during["vllm:num_requests_running"] == 1
            assert during["vllm:kv_cache_usage_perc"] > 0
        wait_for(lambda: idle(tiny_server), 10, "running to drop to 0 and KV usage to return to idle")
        num_steps = len(steps)
        after = metrics(base)
    assert after["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"] == 0.0
    assert num_steps < 100, "the request ran on after its client left"
    # Aborted, not finished: no end-to-end latency was recorded for it.
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"]
    assert not tiny_server.engine.scheduler.requests


def test_streaming_chat_disconnect_aborts(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    before = metrics(base)
    with slow_steps(tiny_server.engine, 0.01):
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG}) as response:
            lines = response.iter_lines()
            for _ in range(3):
                while not next(lines).startswith("data: "):
                    pass
        wait_for(lambda: idle(tiny_server), 10, "running to drop to 0 and KV usage to return to idle")
    after = metrics(base)
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"]


def test_non_streaming_disconnect_aborts(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    before = metrics(base)
    with slow_steps(tiny_server.engine, 0.01) as steps:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", timeout=httpx.Timeout(30, read=0.5), json={
                "messages": [{"role": "user", "content": "hi"}], **LONG})
        assert steps, "the request never started"
        wait_for(lambda: idle(tiny_server), 10, "running to drop to 0 and KV usage to return to idle")
        num_steps = len(steps)
    assert num_steps < 100, "the request ran on after its client left"
    after = metrics(base)
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"]


@pytest.mark.parametrize("stream", [False, True])
def test_batch_disconnect_stops_running_and_never_runs_queued(tiny_server: RunningServer, stream: bool) -> None:
    """Eight prompts on a four-sequence batch: four run, four wait; after the disconnect none runs."""
    base = tiny_server.base_url
    prompts = [f"prompt number {i}: the quick brown fox" for i in range(8)]
    with slow_steps(tiny_server.engine, 0.01) as steps:
        if stream:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=30,
                              json={"prompt": prompts, "stream": True, **LONG}) as response:
                lines = response.iter_lines()
                for _ in range(8):
                    while not next(lines).startswith("data: "):
                        pass
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                           json={"prompt": prompts, **LONG})
        wait_for(lambda: idle(tiny_server), 10, "running to drop to 0 and KV usage to return to idle")
    scheduled = set().union(*steps)
    indexes = sorted(int(request_id.rsplit("-", 1)[1]) for request_id in scheduled)
    assert indexes and set(indexes) <= {0, 1, 2, 3}, f"queued prompts ran: {indexes}"
    assert len(steps) < 100


def test_thousands_of_aborts_leak_nothing(tiny_server: RunningServer) -> None:
    """Clients that leave at random moments (queued, prefilling, decoding): every request is accounted for."""
    base = tiny_server.base_url
    rng = random.Random(0)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"request {i} " + "the quick brown fox " * rng.randint(0, 8), "stream": True,
                "max_tokens": 100, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            num_events = rng.randint(0, 3)
            async for line in response.aiter_lines():
                if num_events == 0:
                    break
                if line.startswith("data: "):
                    num_events -= 1

    async def run() -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
            semaphore = asyncio.Semaphore(32)

            async def bounded(i: int) -> None:
                async with semaphore:
                    await one(http, i)

            await asyncio.gather(*(bounded(i) for i in range(1000)))

    asyncio.run(run())
    wait_for(lambda: idle(tiny_server), 20, "every aborted request to be gone")
    engine = tiny_server.engine
    async_engine = tiny_server.server.async_engine
    wait_for(lambda: async_engine.num_in_flight == 0, 10, "no request in flight")
    assert not engine.scheduler.requests and not len(async_engine.processor)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check_integrity()
    # A step after the aborts lets the metrics drop their per-request state too.
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200
    metrics_state = tiny_server.server.config.app.state.metrics._last_token_s
    assert not metrics_state
