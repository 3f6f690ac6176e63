"""A server with --prefix-cache-dir: a restart serves a long prompt from disk, /metrics tells memory
hits from disk hits and counts the bytes."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import launch_server_process, metrics, start_server

PROMPT = "def parse(line):\n    fields = line.split(',')\n    return {k: v for k, v in zip(KEYS, fields)}\n" * 2
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def complete(base_url: str, model: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    out = client.completions.create(model=model, prompt=PROMPT, logprobs=1, **GREEDY)
    return out.choices[0].logprobs.tokens


def test_restart_hits_the_disk_and_metrics_say_so(tiny_checkpoint: Path, tmp_path: Path) -> None:
    folder = str(tmp_path / "kv")
    first = start_server(tiny_checkpoint, prefix_cache_dir=folder)
    try:
        cold = complete(first.base_url, first.model_name)
        assert first.engine.core.prefix_tier.store.flush(30)   # writes are counted with the next step
        again = complete(first.base_url, first.model_name)   # from memory
        values = metrics(first.base_url)
    finally:
        first.stop()
    assert again == cold
    assert values["vllm:prefix_cache_hits_total"] > 0 and values["vllm:external_prefix_cache_hits_total"] == 0
    assert values["conveyor:prefix_cache_disk_written_bytes_total"] > 0
    second = start_server(tiny_checkpoint, prefix_cache_dir=folder)
    try:
        warm = complete(second.base_url, second.model_name)
        values = metrics(second.base_url)
        prompt_tokens = second.engine.stats.num_prefill_tokens
    finally:
        second.stop()
    assert warm == cold
    assert values["vllm:external_prefix_cache_hits_total"] >= values["vllm:external_prefix_cache_queries_total"] > 0
    assert values["vllm:prefix_cache_hits_total"] == 0   # nothing was in memory after the restart
    assert values["conveyor:prefix_cache_disk_read_bytes_total"] > 0
    assert prompt_tokens < 16   # only the prompt's tail was computed


@pytest.mark.slow
def test_restart_of_the_server_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The command, with its engine core in a process of its own: SIGTERM, start again, same tokens."""
    folder = str(tmp_path / "kv")
    outputs = []
    for _ in range(2):
        process, base = launch_server_process(tiny_checkpoint, "--prefix-cache-dir", folder)
        try:
            model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            outputs.append((complete(base, model), metrics(base)))
        finally:
            process.terminate()
            process.wait(60)
    (cold, _), (warm, values) = outputs
    assert warm == cold and values["vllm:external_prefix_cache_hits_total"] > 0


def slot(base_url: str, action: str, body: dict | None = None, slot_id: str = "0") -> httpx.Response:
    return httpx.post(f"{base_url}/slots/{slot_id}", params={"action": action}, json=body, timeout=30)


def test_slot_files_name_a_prompt_across_restarts(tiny_checkpoint: Path, tmp_path: Path) -> None:
    folder = str(tmp_path / "kv")
    first = start_server(tiny_checkpoint, prefix_cache_dir=folder)
    try:
        assert slot(first.base_url, "save", {"filename": "early"}).status_code == 400   # nothing served yet
        cold = complete(first.base_url, first.model_name)
        saved = slot(first.base_url, "save", {"filename": "parser.bin"}).json()
    finally:
        first.stop()
    assert saved["id_slot"] == 0 and saved["filename"] == "parser.bin" and saved["n_saved"] >= 16
    second = start_server(tiny_checkpoint, prefix_cache_dir=folder)
    try:
        restored = slot(second.base_url, "restore", {"filename": "parser.bin"}).json()
        assert restored["n_restored"] == saved["n_saved"]
        assert complete(second.base_url, second.model_name) == cold
        assert metrics(second.base_url)["vllm:external_prefix_cache_hits_total"] > 0
        assert slot(second.base_url, "restore", {"filename": "other"}).status_code == 404
        assert slot(second.base_url, "erase", {"filename": "parser.bin"}).json()["n_erased"] > 0
        assert slot(second.base_url, "restore", {"filename": "parser.bin"}).status_code == 404
    finally:
        second.stop()


@pytest.mark.parametrize("action,body,slot_id", [
    ("save", {"filename": "../escape"}, "0"), ("save", {"filename": "a/b"}, "0"), ("save", {"filename": ".."}, "0"),
    ("save", {"filename": ".hidden"}, "0"), ("save", {"filename": "x" * 200}, "0"), ("save", {"filename": 3}, "0"),
    ("save", {}, "0"), ("restore", None, "0"), ("load", {"filename": "a"}, "0"),
    ("save", {"filename": "a", "extra": 1}, "0"), ("save", {"filename": "a"}, "-1"), ("save", {"filename": "a"}, "x"),
])
def test_bad_slot_requests_are_400(tiny_server, action: str, body: dict | None, slot_id: str) -> None:  # noqa: ANN001
    response = slot(tiny_server.base_url, action, body, slot_id)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_slot_files_need_the_api_key(keyed_server) -> None:  # noqa: ANN001
    assert slot(keyed_server.base_url, "erase").status_code == 401


def test_slot_files_need_a_prefix_cache_dir(tiny_server) -> None:  # noqa: ANN001
    response = slot(tiny_server.base_url, "restore", {"filename": "a"})
    assert response.status_code == 400 and "--prefix-cache-dir" in response.json()["error"]["message"]
