"""SIGTERM: stop accepting, end in-flight requests (finished or a clear error), exit 0."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    child_pids,
    is_alive,
    launch_server_process,
    metrics,
    slow_steps,
    sse_events,
    start_server,
    wait_for,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def outcome_of_stream(events: list[dict | str]) -> str:
    """'finished' or 'error: <type>'; anything else (a cut stream) fails the test."""
    assert events and events[-1] == "[DONE]", f"stream ended without [DONE]: {events[-3:]}"
    last = events[-2]
    assert isinstance(last, dict)
    if "error" in last:
        return f"error: {last['error']['type']}"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "finished"


@pytest.mark.parametrize("grace_s", ["10", "0"])
def test_sigterm_with_requests_in_flight_exits_0(tiny_checkpoint: Path, grace_s: str) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_checkpoint), "--port", str(port),
         "--threads", "1", "--kv-cache-memory", "64MiB", "--shutdown-grace", grace_s],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        children = child_pids(process.pid)
        assert children, "the engine core runs in a child process"

        async def clients() -> list[str]:
            started = asyncio.Event()
            num_started = 0

            async def streaming(http: httpx.AsyncClient, i: int) -> str:
                nonlocal num_started
                lines = []
                async with http.stream("POST", "/v1/completions", json={
                        "prompt": f"client {i}", "max_tokens": 240, "ignore_eos": True, "stream": True}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and not lines:
                            num_started += 1
                            if num_started == 3:
                                started.set()
                        lines.append(line)
                return outcome_of_stream(sse_events(lines))

            async def whole(http: httpx.AsyncClient) -> str:
                response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 240,
                                                                     "ignore_eos": True})
                if response.status_code == 200:
                    return "finished"
                assert response.status_code == 503, response.text
                return f"error: {response.json()['error']['type']}"

            async def terminate() -> None:
                await started.wait()
                await asyncio.sleep(0.05)
                process.send_signal(signal.SIGTERM)

            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                results = await asyncio.gather(*(streaming(http, i) for i in range(3)), whole(http), terminate())
            return results[:4]

        outcomes = asyncio.run(clients())
        exit_code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = process.stdout.read() if process.stdout else ""
    assert exit_code == 0, log
    assert all(o in ("finished", "error: service_unavailable") for o in outcomes), outcomes
    if grace_s == "10":
        assert outcomes[:3] == ["finished"] * 3, outcomes  # well within the grace period
    assert "shutting down" in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/health", timeout=2)
    wait_for(lambda: not any(is_alive(pid) for pid in children), 10, "no child process left")


def test_grace_period_over_fails_requests_with_a_clear_error(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2, shutdown_grace_s=0.3)
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", f"{running.base_url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True,
                "stream": True}) as response:
            results["stream"] = sse_events(list(response.iter_lines()))

    def whole() -> None:
        response = httpx.post(f"{running.base_url}/v1/completions", timeout=60,
                              json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True})
        results["whole"] = (response.status_code, response.json())

    with slow_steps(running.engine, 0.02):
        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while metrics(running.base_url)["vllm:num_requests_running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.monotonic()
        running.stop(timeout_s=30)  # what SIGTERM does, without a signal
        stopped_after_s = time.monotonic() - started
        for thread in threads:
            thread.join(10)
    assert stopped_after_s < 15
    events = results["stream"]
    assert isinstance(events, list) and events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    status, body = results["whole"]  # type: ignore[misc]
    assert status == 503 and "shutting down" in body["error"]["message"]


def test_during_the_grace_period_health_and_new_requests_get_503(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2, shutdown_grace_s=30)
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", f"{running.base_url}/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}) as response:
            results["stream"] = sse_events(list(response.iter_lines()))

    with slow_steps(running.engine, 0.1):
        thread = threading.Thread(target=stream)
        thread.start()
        wait_for(lambda: metrics(running.base_url)["vllm:num_requests_running"] == 1, 10, "the stream to run")
        running.server.should_exit = True                       # what SIGTERM does
        wait_for(lambda: httpx.get(f"{running.base_url}/health", timeout=5).status_code == 503, 10,
                 "/health to turn 503")
        refused = httpx.post(f"{running.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert thread.is_alive(), "the in-flight stream is still running in the grace period"
        thread.join(60)
    running.stop()
    assert outcome_of_stream(results["stream"]) == "finished"     # in-flight work still finished


def test_an_idle_server_exits_promptly_on_sigterm(tiny_checkpoint: Path) -> None:
    process, base = launch_server_process(tiny_checkpoint)
    try:
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=30)
        exited_after_s = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert exit_code == 0
    assert exited_after_s < 3, f"an idle server took {exited_after_s:.1f} s to exit"   # about 0.3 s when idle
