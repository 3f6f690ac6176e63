"""Tenants through a real server: a tenant past --max-requests-per-tenant gets a 429 naming the limit
while other tenants go on, the X-Tenant header wins over the body's user, and /metrics counts each
tenant under a bounded set of labels."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, metrics, start_server

from conveyor.server import metrics as metrics_module

LONG = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=4, server_options={"max_requests_per_tenant": 2})
    yield running
    running.stop()


def post(server: RunningServer, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)


def test_a_tenant_past_its_limit_gets_a_429_and_others_go_on(server: RunningServer) -> None:
    started = threading.Barrier(3)
    release = threading.Event()

    def hold() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**LONG, "user": "alice"},
                          timeout=60) as response:
            lines = response.iter_lines()
            next(lines)   # the stream has started: the request is in flight
            started.wait()
            release.wait(30)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for thread in holders:
        thread.start()
    started.wait(30)
    try:
        refused = post(server, {**SHORT, "user": "alice"})
        assert refused.status_code == 429, refused.text
        assert refused.headers.get("Retry-After")
        assert "max-requests-per-tenant" in refused.json()["error"]["message"]
        assert post(server, {**SHORT, "user": "bob"}).status_code == 200
        assert post(server, SHORT, **{"X-Tenant": "carol"}).status_code == 200
        # The header names the tenant: alice's user field behind carol's header is carol's request.
        assert post(server, {**SHORT, "user": "alice"}, **{"X-Tenant": "carol"}).status_code == 200
    finally:
        release.set()
        for thread in holders:
            thread.join(30)
    assert post(server, {**SHORT, "user": "alice"}).status_code == 200   # in flight again below the limit


def test_metrics_count_each_tenant_with_bounded_labels(server: RunningServer, monkeypatch) -> None:
    monkeypatch.setattr(metrics_module, "MAX_TENANT_LABELS", 0)   # every new tenant from here is "(other)"
    for tenant in ("dave", "erin"):
        assert post(server, {**SHORT, "user": tenant}).status_code == 200
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'conveyor:tenant_requests_total{model_name="' in text
    assert 'tenant="bob"' in text and 'tenant="(other)"' in text
    assert 'tenant="dave"' not in text and 'tenant="erin"' not in text
    values = metrics(server.base_url)
    assert values["conveyor:tenant_generation_tokens_total"] >= 2 * 3
