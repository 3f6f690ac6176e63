"""The engine core in its own process: its death fails every request at once, and the server exits 1."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_helpers import child_pids, core_pid, is_alive, launch_server_process, metrics, sse_events, wait_for


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
        body = {"prompt": "hello", "max_tokens": 24, "ignore_eos": True, "temperature": 0, "logprobs": 2}
        whole = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()
        text = whole["choices"][0]["text"]
        assert whole["usage"]["completion_tokens"] == 24 and len(whole["choices"][0]["logprobs"]["tokens"]) == 24
        # The front imports no torch (the core process imports it while the front starts): not for the
        # server's modules, the tokenizer, nor the logprobs it unpickles.
        assert "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text()
        # A grammar is compiled by the front, then again by the core on its worker thread.
        pattern = "[a-c]{3}-[0-9]"
        constrained = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": "hello", "max_tokens": 10, "temperature": 0, "guided_regex": pattern}).json()
        assert re.fullmatch(pattern, constrained["choices"][0]["text"]), constrained
        # A stop string found by the front ends the stream there, and the core frees the request.
        stop = text[len(text) // 2:len(text) // 2 + 3]
        with httpx.stream("POST", f"{base}/v1/completions", timeout=30,
                          json={**body, "stream": True, "stop": [stop]}) as response:
            events = sse_events(list(response.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:text.index(stop)]
        # A client that leaves mid-stream has its request aborted in the core.
        with httpx.stream("POST", f"{base}/v1/completions", timeout=30,
                          json={"prompt": "bye", "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
            next(response.iter_lines())
        wait_for(lambda: metrics(base)["vllm:num_requests_running"] == 0, 10, "the aborted request to go")
        os.killpg(process.pid, signal.SIGINT)   # as Ctrl-C does: the core gets it too, and must not die of it
        exit_code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = process.stdout.read() if process.stdout else ""
    assert exit_code == 0, log
    assert "engine core process" in log and "1 torch threads" in log   # --threads 1 reached the core
    wait_for(lambda: not is_alive(core), 10, "the core to stop")


def test_core_start_up_error_is_reported_and_exits_2(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    result = subprocess.run([sys.executable, "-m", "conveyor", "serve", "--model", str(broken), "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "is not a readable safetensors file" in result.stderr   # raised in the core, shown by the front


def test_big_messages_cross_the_pipe_under_uvloop(tiny_checkpoint: Path) -> None:
    """uvloop makes a reader's fd non-blocking; a message larger than what has arrived (a batch
    snapshot of 16384 KV blocks) must still be read whole, not taken for the core's death."""
    uvloop = pytest.importorskip("uvloop")
    from conveyor.config import EngineConfig
    from conveyor.engine.core_process import ProcessCoreClient
    from conveyor.engine.messages import WatchBatch

    # float32 KV whatever the CPU, so 128 MiB is more than 8192 blocks everywhere.
    client = ProcessCoreClient(EngineConfig.from_options(model=str(tiny_checkpoint), threads=1, dtype="float32",
                                                         kv_cache_memory="128MiB"))
    client.wait_ready()
    deaths: list[str] = []

    async def main() -> None:
        snapshots = []
        arrived = asyncio.Event()

        def on_outputs(outputs) -> None:   # noqa: ANN001
            if outputs.snapshot is not None:
                snapshots.append(outputs.snapshot)
                arrived.set()

        client.start(asyncio.get_running_loop(), on_outputs, deaths.append)
        assert os.get_blocking(client._conn.fileno())
        for _ in range(5):
            arrived.clear()
            client.send(WatchBatch(0.25))   # each watch asks for a snapshot at once
            await asyncio.wait_for(arrived.wait(), 10)
        assert len(snapshots[-1].block_states) == client.info.num_kv_blocks > 65536 // 8
        await client.close()

    uvloop.run(main())
    assert deaths == []
