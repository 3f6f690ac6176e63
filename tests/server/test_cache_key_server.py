"""QVAC's per-request cache key (`cacheKey`, `saveCacheToDisk`, or snake_case) on a real server with
--prefix-cache-dir: a saved prompt prefix is named on disk and restored after a restart without being
computed again; a bad key is a 400."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import RunningServer, metrics, start_server

SYSTEM = "You plan trips. Lisbon to Kyoto on 3 May, four nights by the river, Osaka on 7 May, home on 9 May."
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


def chat(server: RunningServer, messages: list[dict], **fields: object) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    out = client.chat.completions.create(model=server.model_name, messages=messages, logprobs=True,
                                         **{**GREEDY, "extra_body": {**GREEDY["extra_body"], **fields}})
    return [t.token for t in out.choices[0].logprobs.content]


def named(folder: Path, key: str, timeout_s: float = 20.0) -> Path:
    """The key's name file, once the server has written it (the save runs after the response)."""
    deadline = time.monotonic() + timeout_s
    while not (found := list(folder.glob(f"*/named/{key}.json"))):
        assert time.monotonic() < deadline, f"no name {key} saved"
        time.sleep(0.05)
    return found[0]


@pytest.fixture(scope="module")
def disk_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(tiny_checkpoint, prefix_cache_dir=str(tmp_path_factory.mktemp("kv")))
    yield server
    server.stop()


def test_a_saved_key_is_restored_after_a_restart(tiny_checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do I sleep?"}]
    first = start_server(tiny_checkpoint, prefix_cache_dir=str(folder))
    try:
        cold = chat(first, first_turn, cacheKey="trip-planner", saveCacheToDisk=True)
        manifest = named(folder, "trip-planner")
        unsaved = chat(first, first_turn[:1] + [{"role": "user", "content": "Hi"}], cache_key="other")
    finally:
        first.stop()
    assert len(unsaved) == len(cold) and not list(folder.glob("*/named/other.json"))   # a key alone saves nothing
    assert manifest.stat().st_size > 0
    second = start_server(tiny_checkpoint, prefix_cache_dir=str(folder))
    try:
        # The same conversation, one turn on, under the same key: its saved prefix is read back.
        warm = chat(second, first_turn, cache_key="trip-planner")
        values = metrics(second.base_url)
        computed = second.engine.stats.num_prefill_tokens
        assert chat(second, first_turn + [{"role": "assistant", "content": "".join(cold)},
                                          {"role": "user", "content": "And in Osaka?"}],
                    cache_key="trip-planner", save_cache_to_disk=True)
    finally:
        second.stop()
    assert warm == cold
    assert values["vllm:external_prefix_cache_hits_total"] > 0 and values["vllm:prefix_cache_hits_total"] == 0
    assert computed < 16   # only the prompt's tail was computed


@pytest.mark.parametrize("fields", [
    {"cache_key": "../escape"}, {"cacheKey": "a/b"}, {"cache_key": ".."}, {"cache_key": ".hidden"},
    {"cache_key": "x" * 200}, {"cache_key": 3}, {"cache_key": ""}, {"save_cache_to_disk": True},
    {"saveCacheToDisk": "yes"}, {"cache_key": "two", "n": 2},
])
def test_bad_cache_keys_are_400(disk_server: RunningServer, fields: dict) -> None:
    body = {"model": disk_server.model_name, "prompt": "hello", "max_tokens": 2, **fields}
    response = httpx.post(f"{disk_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"


def test_a_cache_key_needs_a_prefix_cache_dir(tiny_server: RunningServer) -> None:
    body = {"model": tiny_server.model_name, "prompt": "hello", "max_tokens": 2, "cacheKey": "a"}
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and "--prefix-cache-dir" in response.json()["error"]["message"]
