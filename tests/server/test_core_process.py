"""The engine core in its own process: its death fails every request at once, and the server exits 1."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
from server_helpers import child_pids, core_pid, is_alive, launch_server_process, sse_events, wait_for


def test_core_killed_fails_requests_in_flight_and_the_server_exits_1(tiny_checkpoint: Path) -> None:
    process, base = launch_server_process(tiny_checkpoint, "--shutdown-grace", "30")
    try:
        core = core_pid(process.pid)
        children = child_pids(process.pid)

        async def clients() -> tuple[list[list[dict | str]], httpx.Response, int, int]:
            started = asyncio.Event()

            async def streaming(http: httpx.AsyncClient, i: int) -> list[dict | str]:
                lines = []
                async with http.stream("POST", "/v1/completions", json={
                        "prompt": f"client {i}", "max_tokens": 240, "ignore_eos": True, "stream": True}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            started.set()
                        lines.append(line)
                return sse_events(lines)

            async def whole(http: httpx.AsyncClient) -> httpx.Response:
                return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 240,
                                                                 "ignore_eos": True})

            async def kill() -> None:
                await started.wait()
                os.kill(core, signal.SIGKILL)

            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                *streams, answer, _ = await asyncio.gather(*(streaming(http, i) for i in range(2)), whole(http),
                                                           kill())
                # The port stays open a moment after the death, answering 503 to everything.
                health = await http.get("/health")
                refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return streams, answer, health.status_code, refused.status_code

        streams, answer, health_status, new_status = asyncio.run(clients())
        exit_code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = process.stdout.read() if process.stdout else ""
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["type"] == "service_unavailable" and "engine core process died" in error["message"], error
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "service_unavailable"
    assert health_status == 503 and new_status == 503
    assert exit_code == 1, log
    assert "engine core process died (killed by signal 9)" in log
    wait_for(lambda: not any(is_alive(pid) for pid in children), 10, "no child process left")


def test_core_process_serves_and_stops_with_the_server(tiny_checkpoint: Path) -> None:
    process, base = launch_server_process(tiny_checkpoint)
    try:
        core = core_pid(process.pid)
        response = httpx.post(f"{base}/v1/completions", timeout=30,
                              json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True, "stop": ["zzz"]})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
        os.killpg(process.pid, signal.SIGINT)   # as Ctrl-C does: the core gets it too, and must not die of it
        exit_code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = process.stdout.read() if process.stdout else ""
    assert exit_code == 0, log
    assert "engine core process" in log and "ready" in log
    wait_for(lambda: not is_alive(core), 10, "the core to stop")
