"""OpenAI's Files and Batches API through a real server and the official client: a batch runs in the
spare capacity with per-line errors, can be cancelled, and survives a server killed mid-job (the
same --state-dir) with no line lost or run twice."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import RunningServer, launch_server_process, start_server


def lines(count: int, max_tokens: int = 8) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"hello {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(count)]


def upload(client: openai.OpenAI, path: Path, rows: list, extra: list[str] = ()) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "".join(text + "\n" for text in extra))
    with path.open("rb") as f:
        return client.files.create(file=f, purpose="batch").id


def wait_for_batch(client: openai.OpenAI, batch_id: str, done=("completed", "cancelled", "failed"),
                   timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(text) for text in client.files.content(file_id).text.splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a line was answered twice"
    return by_id


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    state = tmp_path_factory.mktemp("state")
    running = start_server(tiny_checkpoint, max_num_seqs=4, server_options={"state_dir": str(state)})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_a_batch_runs_every_line_and_reports_bad_ones(client: openai.OpenAI, tmp_path: Path) -> None:
    bad = ["{broken", json.dumps({"custom_id": "hot", "url": "/v1/completions",
                                  "body": {"prompt": "x", "temperature": -1}}),
           json.dumps({"custom_id": "chat-line", "url": "/v1/chat/completions", "body": {"messages": []}})]
    file_id = upload(client, tmp_path / "in.jsonl", lines(10), bad)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.total == 13 and batch.request_counts.completed == 10
    assert batch.request_counts.failed == 3
    ok, failed = results(client, batch.output_file_id), results(client, batch.error_file_id)
    assert sorted(ok) == sorted(f"req-{i}" for i in range(10))
    for row in ok.values():
        assert row["response"]["status_code"] == 200 and row["response"]["body"]["usage"]["completion_tokens"] == 8
    assert set(failed) == {"line-11", "hot", "chat-line"}
    assert failed["hot"]["response"]["status_code"] == 400
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert any(b.id == batch.id for b in client.batches.list().data)


def test_an_interactive_request_is_not_held_behind_a_batch(client: openai.OpenAI, server: RunningServer,
                                                           tmp_path: Path) -> None:
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", lines(40, max_tokens=64)),
                                  endpoint="/v1/completions", completion_window="24h")
    wait_for_batch(client, batch.id, done=("in_progress",))
    started = time.monotonic()
    client.completions.create(model=server.model_name, prompt="quick", max_tokens=4, temperature=0)
    interactive_s = time.monotonic() - started
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 40
    assert interactive_s < time.monotonic() - started   # it finished long before the batch


def test_a_cancelled_batch_keeps_what_it_finished(client: openai.OpenAI, tmp_path: Path) -> None:
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", lines(60, max_tokens=100)),
                                  endpoint="/v1/completions", completion_window="24h")
    wait_for_batch(client, batch.id, done=("in_progress",))
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed < 60
    assert len(results(client, batch.output_file_id)) == batch.request_counts.completed


def test_unknown_ids_and_bad_input_get_openai_errors(server: RunningServer) -> None:
    base = server.base_url
    assert httpx.get(f"{base}/v1/batches/batch_nope").status_code == 404
    assert httpx.get(f"{base}/v1/files/file-nope/content").status_code == 404
    response = httpx.post(f"{base}/v1/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/completions"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "input_file_id"
    response = httpx.post(f"{base}/v1/batches", json={"input_file_id": "x", "endpoint": "/v1/embeddings"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "endpoint"
    response = httpx.post(f"{base}/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "fine-tune"})
    assert response.status_code == 400


def test_a_batch_survives_a_killed_server(tiny_checkpoint: Path, tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    flags = ("--state-dir", state, "--max-num-seqs", "2", "--no-core-process")
    process, base = launch_server_process(tiny_checkpoint, *flags)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", lines(30, max_tokens=150)),
                                      endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    process, base = launch_server_process(tiny_checkpoint, *flags)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        assert client.batches.retrieve(batch.id).request_counts.completed < 30   # it stopped mid-job
        batch = wait_for_batch(client, batch.id, timeout_s=240)
        assert batch.status == "completed" and batch.request_counts.completed == 30
        ok = results(client, batch.output_file_id)
        assert sorted(ok) == sorted(f"req-{i}" for i in range(30))
        assert all(row["response"]["body"]["usage"]["completion_tokens"] == 150 for row in ok.values())
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
