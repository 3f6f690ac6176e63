"""Clients without the key, slow bodies and deep JSON cannot take the server from clients with the key."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, RunningServer, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def capped_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, api_key=API_KEY, max_num_seqs=2,
                           server_options={"max_concurrency": 2, "body_timeout_s": 30.0})
    yield running
    running.stop()


def slow_request(server: RunningServer, head: bytes) -> socket.socket:
    """A request whose headers promise a body that never comes."""
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=20)
    sock.sendall(head + b"Host: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    return sock


def test_slow_bodies_without_a_key_take_no_slot(capped_server: RunningServer) -> None:
    held = [slow_request(capped_server, b"GET /docs HTTP/1.1\r\n") for _ in range(6)]
    held += [slow_request(capped_server, b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer wrong\r\n")
             for _ in range(2)]
    held += [slow_request(capped_server, b"POST /v1/completions HTTP/1.1\r\n" +
                          f"Authorization: Bearer {API_KEY}\r\n".encode()) for _ in range(3)]
    try:
        for sock in held[6:8]:   # a wrong key is answered on its headers, the body never awaited
            assert sock.recv(65536).startswith(b"HTTP/1.1 401")
        with httpx.Client(base_url=capped_server.base_url, headers=AUTH, timeout=30) as http:
            for _ in range(3):
                response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert response.status_code == 200, response.text
            assert http.get("/health").status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_a_get_body_without_a_key_is_kept_small(capped_server: RunningServer) -> None:
    response = httpx.request("GET", f"{capped_server.base_url}/health", content=b"x" * (1024 * 1024), timeout=30)
    assert response.status_code == 413, response.text
    assert httpx.get(f"{capped_server.base_url}/health", timeout=30).status_code == 200


def test_a_deeply_nested_body_is_a_400(capped_server: RunningServer) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    response = httpx.post(f"{capped_server.base_url}/v1/completions", timeout=30,
                          headers={**AUTH, "Content-Type": "application/json"},
                          content=f'{{"prompt": "hi", "logit_bias": {deep}}}')
    assert response.status_code == 400, response.text
    assert "levels deep" in response.json()["error"]["message"]


def test_deeply_nested_tool_call_arguments_are_a_400(capped_server: RunningServer) -> None:
    arguments = "[" * 100_000 + "]" * 100_000
    body = {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}
    response = httpx.post(f"{capped_server.base_url}/v1/chat/completions", headers=AUTH, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "levels deep" in error["message"] and error["param"] == "messages.1.tool_calls.0.function.arguments"


def test_brackets_inside_strings_are_not_nesting(capped_server: RunningServer) -> None:
    response = httpx.post(f"{capped_server.base_url}/v1/completions", headers=AUTH, timeout=30,
                          json={"prompt": "hi", "stop": ["[" * 200], "max_tokens": 2})
    assert response.status_code == 200, response.text
