"""Queue time split by cause through a real server's /metrics: requests that wait for a seat in the
batch count under "budget", one that waits for a shared prefix another request is computing under
"prefix"; every finished request observes each cause, and the causes add up to the queue time."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import RunningServer, slow_steps, start_server, wait_for

from conveyor.core.request import WAIT_CAUSES

BY_CAUSE = "conveyor:request_queue_time_by_cause_seconds"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=3, max_num_batched_tokens=64)
    yield running
    running.stop()


def samples(base_url: str) -> dict[tuple[str, str], float]:
    """(sample name, cause label or "") -> value, from /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {(s.name, s.labels.get("cause", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_queue_time_by_cause_adds_up_to_the_queue_time(server: RunningServer) -> None:
    shared = [10 + (7 * i) % 150 for i in range(200)]     # nobody computed it yet; 200 tokens, chunks of 64
    bodies = [{"prompt": shared, "max_tokens": 4, "ignore_eos": True},
              {"prompt": shared + [3], "max_tokens": 4, "ignore_eos": True}]
    bodies += [{"prompt": [20 + i, 21, 22, 23], "max_tokens": 4, "ignore_eos": True} for i in range(3)]

    def post(body: dict) -> int:
        return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code

    scheduler = server.engine.scheduler
    with slow_steps(server.engine, 0.05), ThreadPoolExecutor(len(bodies)) as pool:
        futures = []
        # In this order, each once the one before is in the scheduler: the second shared prompt arrives
        # while the first computes it (4 steps of 50 ms or more), the short ones after it.
        for count, body in enumerate(bodies, 1):
            futures.append(pool.submit(post, body))
            if count <= 2:
                wait_for(lambda: len(scheduler.requests) >= count, what=f"request {count} in the scheduler")
        statuses = [future.result() for future in futures]
    assert statuses == [200] * len(bodies)
    values = samples(server.base_url)
    count = values[("vllm:request_queue_time_seconds_count", "")]
    total = values[("vllm:request_queue_time_seconds_sum", "")]
    assert count == len(bodies)
    assert {cause: values[(f"{BY_CAUSE}_count", cause)] for cause in WAIT_CAUSES} == dict.fromkeys(WAIT_CAUSES, count)
    by_cause = {cause: values[(f"{BY_CAUSE}_sum", cause)] for cause in WAIT_CAUSES}
    assert sum(by_cause.values()) == pytest.approx(total, abs=0.005)
    assert by_cause["prefix"] > 0 and by_cause["budget"] > 0, by_cause


def test_batch_config_info_names_the_long_prompt_chunk_cap(server: RunningServer) -> None:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    (line,) = [line for line in text.splitlines() if line.startswith("conveyor:batch_config_info{")]
    assert 'long_prefill_max_chunk="256"' in line
