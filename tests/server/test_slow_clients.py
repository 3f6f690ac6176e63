"""Slow clients cannot hold connections: headers, bodies and idle keep-alives each have a timeout."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, slow_steps, start_server, wait_for

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def strict_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=2, server_options={
        "header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S, "keep_alive_timeout_s": TIMEOUT_S})
    yield running
    running.stop()


def connect(server: RunningServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=20)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes the connection (a hang fails on the socket timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def num_connections(server: RunningServer) -> int:
    return len(server.server.server_state.connections)


@pytest.mark.parametrize("sent", [
    b"",                                                              # nothing at all
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app",  # half a header
])
def test_incomplete_headers_are_closed_after_the_timeout(strict_server: RunningServer, sent: bytes) -> None:
    with connect(strict_server) as sock:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""


def test_a_slow_body_gets_408(strict_server: RunningServer) -> None:
    with connect(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 408"), response[:200]
    assert b'"code":"request_timeout"' in response


def test_a_half_sent_second_request_on_a_keep_alive_connection_is_closed(strict_server: RunningServer) -> None:
    with connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert read_until_closed(sock) == b""


def test_many_slow_connections_do_not_pile_up(strict_server: RunningServer) -> None:
    before = num_connections(strict_server)
    sockets = [connect(strict_server) for _ in range(100)]
    try:
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        wait_for(lambda: num_connections(strict_server) <= before, 20, "the slow connections to be closed")
        response = httpx.post(f"{strict_server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              timeout=30)
        assert response.status_code == 200
    finally:
        for sock in sockets:
            sock.close()


def test_requests_within_the_timeouts_are_served(strict_server: RunningServer) -> None:
    with httpx.Client(base_url=strict_server.base_url, timeout=30) as http:
        for _ in range(3):   # one keep-alive connection, requests back to back
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_past_max_concurrency_new_requests_get_503(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"max_concurrency": 2})
    body = {"prompt": "hi", "max_tokens": 30, "ignore_eos": True, "stream": True}
    try:
        with slow_steps(running.engine, 0.05), httpx.Client(base_url=running.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as first, \
                    http.stream("POST", "/v1/completions", json=body) as second:
                assert first.status_code == second.status_code == 200
                busy = httpx.post(f"{running.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                  timeout=10)
                assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy", busy.text
                assert int(busy.headers["retry-after"]) >= 1
                assert httpx.get(f"{running.base_url}/health", timeout=10).status_code == 200   # probes pass
        response = httpx.post(f"{running.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              timeout=30)
        assert response.status_code == 200
    finally:
        running.stop()
