"""A core that stops stepping without dying is noticed: /health turns 503 and the requests waiting
on it fail with a 503 in our words, and both recover once it steps again. SIGTERM still stops a
server whose chat template is running away."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
from server_helpers import core_pid, launch_server_process, slow_steps, sse_events, start_server, wait_for

from conveyor.front.core_watchdog import CoreWatchdog

RUNAWAY_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


def status(base: str, path: str = "/health") -> int:
    return httpx.get(f"{base}{path}", timeout=10).status_code


def test_slow_steps_past_the_stall_timeout_fail_requests_and_recover(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"core_stall_timeout_s": 1.0})
    base = running.base_url
    try:
        result: list[httpx.Response] = []
        with slow_steps(running.engine, 3.0):
            worker = threading.Thread(target=lambda: result.append(httpx.post(
                f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 20, "ignore_eos": True}, timeout=60)))
            worker.start()
            wait_for(lambda: status(base) == 503, 20, "/health to turn 503")
            worker.join(30)
            refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        error = result[0].json()["error"]
        assert result[0].status_code == 503 and "made no progress" in error["message"], result[0].text
        assert refused.status_code == 503, refused.text
        wait_for(lambda: status(base) == 200, 20, "/health to recover")
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 200, response.text
    finally:
        running.stop()


def test_an_idle_core_is_never_stalled(tiny_server) -> None:
    engine = tiny_server.server.async_engine
    watchdog = CoreWatchdog(engine, 0.001, clock=lambda: engine.last_progress_s + 3600.0)
    watchdog.check()   # an hour of silence, with nothing owed
    assert engine.stall_reason is None and status(tiny_server.base_url) == 200


def test_a_stopped_core_process_is_noticed_and_sigterm_still_works(tiny_checkpoint: Path) -> None:
    process, base = launch_server_process(tiny_checkpoint, "--core-stall-timeout", "1", "--shutdown-grace", "1",
                                          "--chat-template", RUNAWAY_TEMPLATE)
    core = core_pid(process.pid)
    try:
        lines: list[str] = []
        body = {"prompt": "hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 3:   # streaming: stop the core mid-request
                    os.kill(core, signal.SIGSTOP)
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert any(isinstance(e, dict) and "made no progress" in e.get("error", {}).get("message", "")
                   for e in events), events[-3:]
        assert status(base) == 503
        os.kill(core, signal.SIGCONT)
        wait_for(lambda: status(base) == 200, 30, "/health to recover")
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=30).status_code == 200

        chat = threading.Thread(target=lambda: httpx.post(
            f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60))
        chat.start()
        time.sleep(1.0)   # the render is under way
        assert status(base) == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=40) == 0
        chat.join(30)
    finally:
        if process.poll() is None:
            os.kill(core, signal.SIGCONT)
            process.kill()
            process.wait()
