"""What `conveyor serve` writes while it starts and serves, read from a real server process: one
line per start-up phase with its seconds, uvicorn's lines under `uvicorn` (not `uvicorn.error`),
and no access line for a healthy /health probe while other requests keep theirs."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
from server_helpers import launch_server_process

PHASES = [
    r"conveyor\.text\.tokenizer_loader: tokenizer of \S+ loaded in \d+\.\d\d s",
    r"conveyor\.runtime\.runtime_builder: start-up: C kernels (ready|unavailable \(torch kernels\)) in \d+\.\d\d s",
    r"conveyor\.model\.loader: loaded \S+ \(.*\) as \S+ on cpu in \d+\.\d\d s",
    r"conveyor\.runtime\.runtime_builder: start-up: KV cache of \d+ blocks .* allocated in \d+\.\d\d s",
    r"conveyor\.engine\.core: start-up: engine core ready in \d+\.\d\d s",
    r"conveyor\.server\.api_server: start-up: ready, serving \S+ on http://127\.0\.0\.1:\d+, \d+\.\d\d s after start-up began",
]


def test_start_up_phases_uvicorn_names_and_quiet_health_probes(tiny_checkpoint: Path) -> None:
    process, base = launch_server_process(tiny_checkpoint)
    try:
        for _ in range(5):
            assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=30).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        output = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    for phase in PHASES:
        assert re.search(phase, output), f"no line matching {phase!r} in:\n{output}"
    assert "uvicorn.error" not in output
    assert re.search(r" uvicorn: Uvicorn running on http://127\.0\.0\.1:\d+", output), output
    access = [line for line in output.splitlines() if " uvicorn.access: " in line]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in access), output
    assert not [line for line in access if "/health" in line], access
