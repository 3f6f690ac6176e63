"""Big prompts: refused before tokenizing past the character limit (413); below it, tokenized and
templated on a worker thread, so /health and other requests are answered meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import RunningServer, start_server

BIG = 200_000   # characters: past the size tokenized on the event loop


@pytest.fixture(scope="module")
def roomy_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=2, max_body_bytes=4 * 1024 * 1024,
                           server_options={"max_prompt_chars": 4_000_000})
    yield running
    running.stop()


def test_prompt_over_the_automatic_limit_is_413_before_tokenizing(tiny_server: RunningServer, monkeypatch) -> None:
    tokenizer = tiny_server.engine.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *args, **kwargs: calls.append(args) or [])
    limit = 256 * tokenizer.max_token_chars         # max_model_len times the longest token
    for path, body, param in [
        ("/v1/completions", {"prompt": "a" * (limit + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["a" * limit, "b"]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}, "messages"),
    ]:
        response = httpx.post(f"{tiny_server.base_url}{path}", json=body, timeout=30)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "prompt_too_long" and error["param"] == param, error
        assert str(limit) in error["message"]
    assert calls == []


@pytest.mark.parametrize("path,body,blocked", [
    ("/v1/completions", {"prompt": "hello " * (BIG // 6), "max_tokens": 2}, "encode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * (BIG // 6)}], "max_tokens": 2},
     "apply_chat_template"),
])
def test_health_answers_while_a_big_prompt_is_processed(roomy_server: RunningServer, monkeypatch, path: str,
                                                        body: dict, blocked: str) -> None:
    """The tokenizer step waits until /health has answered: on the event loop it never could."""
    tokenizer = roomy_server.engine.tokenizer
    original: Callable[..., Any] = getattr(tokenizer, blocked)
    entered, health_answered = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert health_answered.wait(20), "/health did not answer while the prompt was being processed"
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, blocked, held)
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.update(
        big=httpx.post(f"{roomy_server.base_url}{path}", json=body, timeout=60)))
    thread.start()
    assert entered.wait(20)
    assert httpx.get(f"{roomy_server.base_url}/health", timeout=10).status_code == 200
    health_answered.set()
    thread.join(60)
    # The prompt is far past the model length: refused once its tokens are counted.
    assert result["big"].status_code == 400
    assert result["big"].json()["error"]["code"] == "context_length_exceeded"


def rss_mib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) // 1024


def test_memory_is_returned_after_a_big_prompt(roomy_server: RunningServer) -> None:
    body = {"prompt": "hello world, the quick brown fox. " * 100_000, "max_tokens": 2}   # 3.4 MB
    url = f"{roomy_server.base_url}/v1/completions"
    assert httpx.post(url, json={"prompt": "warm up", "max_tokens": 2}, timeout=60).status_code == 200
    before = rss_mib()
    response = httpx.post(url, json=body, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    # Untrimmed, tokenizing it leaves about 300 MB of freed buffers in the process.
    assert rss_mib() - before < 100, f"RSS grew from {before} MiB to {rss_mib()} MiB"
