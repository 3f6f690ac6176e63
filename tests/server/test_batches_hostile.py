"""Batch jobs never take the server from others: through a real server, a running batch leaves every
interactive limit (--max-concurrency, the waiting queue, the per-tenant cap) to interactive requests,
files and batches are each tenant's own, a full disk is a 507 and a failed batch (the next batch
still runs), input lines split only at \\n, repeated custom_ids are refused, and /health answers
while a 50,000-line file is split."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import RunningServer, start_server
from test_batches_server import lines, results, wait_for_batch

from conveyor.server.batch.store import BatchStore

_UNLIMITED_PAGES = 1_073_741_823


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    state = tmp_path_factory.mktemp("state")
    running = start_server(tiny_checkpoint, max_num_seqs=4, max_waiting_requests=0, max_body_bytes=32 * 2**20,
                           server_options={"state_dir": str(state), "max_concurrency": 4,
                                           "max_requests_per_tenant": 1})
    yield running
    running.stop()


def client_of(server: RunningServer, tenant: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         default_headers={"X-Tenant": tenant} if tenant else None)


def store_of(server: RunningServer) -> BatchStore:
    return server.server.config.app.state.batch_store


def upload_text(client: openai.OpenAI, text: str) -> str:
    return client.files.create(file=("in.jsonl", text.encode("utf-8")), purpose="batch").id


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def test_a_running_batch_leaves_every_interactive_limit_to_interactive_requests(server: RunningServer) -> None:
    owner = client_of(server, "t0")
    batch = owner.batches.create(input_file_id=upload_text(owner, jsonl(lines(24, max_tokens=48))),
                                 endpoint="/v1/completions", completion_window="24h")
    wait_for_batch(owner, batch.id, done=("in_progress",))

    def interactive(i: int) -> int:   # four tenants at once: the cap (4), one each, nobody may wait
        response = httpx.post(f"{server.base_url}/v1/completions", headers={"X-Tenant": f"t{i}"},
                              json={"prompt": "quick", "max_tokens": 4}, timeout=60)
        return response.status_code

    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(interactive, range(4))) == [200] * 4
    batch = wait_for_batch(owner, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 24


def test_files_and_batches_are_each_tenants_own(server: RunningServer) -> None:
    alice, bob = client_of(server, "alice"), client_of(server, "bob")
    file_id = upload_text(alice, jsonl(lines(2, max_tokens=2)))
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in {f.id for f in bob.files.list().data}
    assert batch.id not in {b.id for b in bob.batches.list().data}
    batch = wait_for_batch(alice, batch.id)
    assert batch.status == "completed" and len(results(alice, batch.output_file_id)) == 2
    with pytest.raises(openai.NotFoundError):
        bob.files.content(batch.output_file_id)


def test_lines_split_at_newline_only_and_repeated_custom_ids_are_refused(server: RunningServer) -> None:
    client = client_of(server)
    rows = lines(19, max_tokens=2)
    for i, separator in enumerate(["\u2028", "\u0085", "\u2029"]):
        rows[i]["body"]["prompt"] = f"one{separator}two"
    deep = '{"custom_id": "deep", "url": "/v1/completions", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    batch = client.batches.create(input_file_id=upload_text(client, jsonl(rows) + deep + "\n"),
                                  endpoint="/v1/completions", completion_window="24h")
    batch = wait_for_batch(client, batch.id)
    assert batch.request_counts.total == 20 and batch.request_counts.completed == 19
    assert "nested too deeply" in results(client, batch.error_file_id)["line-20"]["error"]["message"]
    repeated = jsonl(lines(3, max_tokens=2) + lines(1, max_tokens=2))
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=upload_text(client, repeated), endpoint="/v1/completions",
                              completion_window="24h")
    assert refused.value.code == "duplicate_custom_id" and "req-0" in refused.value.message


def test_a_full_disk_is_a_507_and_fails_the_batch_and_the_next_batch_runs(server: RunningServer) -> None:
    client, store = client_of(server), store_of(server)
    file_id = upload_text(client, jsonl(lines(30, max_tokens=32)))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    # SQLite's page cap is a real SQLITE_FULL: the database cannot grow past the pages it has now.
    store.db.execute(f"PRAGMA max_page_count = {store.db.execute('PRAGMA page_count').fetchone()[0]}")
    try:
        response = httpx.post(f"{server.base_url}/v1/files", files={"file": ("a.jsonl", b"x" * 200_000)},
                              data={"purpose": "batch"}, timeout=30)
        assert response.status_code == 507, response.text
        assert response.json()["error"]["type"] == "server_error"
        assert response.json()["error"]["code"] == "insufficient_storage"
        failed = wait_for_batch(client, batch.id, done=("failed", "completed"))
        assert failed.status == "failed", failed.request_counts
        assert "could not store" in failed.errors.data[0].message
    finally:
        store.db.execute(f"PRAGMA max_page_count = {_UNLIMITED_PAGES}")
    later = client.batches.create(input_file_id=upload_text(client, jsonl(lines(3, max_tokens=2))),
                                  endpoint="/v1/completions", completion_window="24h")
    later = wait_for_batch(client, later.id)
    assert later.status == "completed" and later.request_counts.completed == 3


def test_health_answers_while_a_50000_line_file_is_split(server: RunningServer) -> None:
    client = client_of(server)
    file_id = upload_text(client, jsonl(lines(50_000, max_tokens=1)))
    created: list = []
    creating = threading.Thread(target=lambda: created.append(client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")))
    slowest_s, until_s = 0.0, float("inf")
    creating.start()
    # Through the split, then a second more while the runner loads the 50,000 pending lines.
    while time.monotonic() < until_s:
        if not creating.is_alive() and until_s == float("inf"):
            until_s = time.monotonic() + 1.0
        started = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        slowest_s = max(slowest_s, time.monotonic() - started)
        time.sleep(0.02)
    creating.join()
    batch = client.batches.cancel(created[0].id)
    assert batch.request_counts.total == 50_000
    assert slowest_s < 1.0
    assert wait_for_batch(client, batch.id).status == "cancelled"
