"""A real server with two tensor-parallel ranks: a rank that dies ends its requests with a 503
(the engine is down), never a hang or a 500."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from server_helpers import start_server


def test_a_lost_rank_ends_every_request_with_a_503(tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    server = start_server(tiny_checkpoint_factory("llama"), threads=2, tensor_parallel_size=2, dtype="float32")
    try:
        body = {"model": server.model_name, "prompt": "hello", "max_tokens": 4}
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            first = client.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            server.engine.core.runner.workers[0].kill()
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert "tensor-parallel" in refused.json()["error"]["message"]
    finally:
        server.stop()
