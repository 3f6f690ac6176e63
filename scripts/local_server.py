"""What the scripts that start a local server share: a free loopback port, and waiting for readiness."""

from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 300) -> None:
    """Until `url` answers 200 (a server loading its model refuses connections meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready")
