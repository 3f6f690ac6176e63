"""`conveyor serve --replicas 2` on a local Ray cluster (loopback only): routing, API, metrics, a replica killed.

One cluster for the module (Ray and the deployment take ~15 s to start); the test that kills a
replica runs last.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]'): replica tests skipped")

import ray  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from conveyor.config import EngineConfig, ReplicaConfig, ServerConfig  # noqa: E402
from conveyor.replicas.launch import connect_ray, deploy  # noqa: E402

pytestmark = pytest.mark.ray
REPLICA = "x-conveyor-replica"
SHARED_PREFIX = "You are a terse assistant for the shipping desk; answer in one line. " * 3


@dataclass
class Cluster:
    base_url: str
    model: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint: Path) -> Iterator[Cluster]:
    port = _free_port()
    connect_ray(None, num_cpus=2, log_to_driver=False)
    try:
        config = EngineConfig.from_options(model=str(tiny_checkpoint), threads=1, kv_cache_memory="64MiB",
                                           max_num_batched_tokens=512)
        server = ServerConfig(host="127.0.0.1", port=port, core_process=False, shutdown_grace_s=1.0)
        deploy(config, server, ReplicaConfig(num_replicas=2, metrics_push_interval_s=0.5))
        yield Cluster(f"http://127.0.0.1:{port}", tiny_checkpoint.name)
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(cluster: Cluster, prompt: str, max_tokens: int = 4) -> str:
    raw = cluster.client().completions.with_raw_response.create(model=cluster.model, prompt=prompt,
                                                                max_tokens=max_tokens)
    assert raw.parse().choices[0].finish_reason in ("length", "stop")
    return raw.headers[REPLICA]


def _metrics(cluster: Cluster) -> dict[str, list]:
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=30).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_requests_spread_over_both_replicas(cluster: Cluster) -> None:
    prompts = [f"Request number {i} asks about something different: {'xyz' * i}" for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replicas = list(pool.map(lambda p: _complete(cluster, p, max_tokens=16), prompts))
    assert len(set(replicas)) == 2, replicas


def test_same_prefix_goes_to_the_same_replica(cluster: Cluster) -> None:
    replicas = {_complete(cluster, SHARED_PREFIX + f"Question {i}: where is parcel {i}?") for i in range(4)}
    assert len(replicas) == 1
    chat = cluster.client().chat.completions.with_raw_response.create(
        model=cluster.model, max_tokens=4, messages=[{"role": "system", "content": SHARED_PREFIX},
                                                     {"role": "user", "content": "hello"}])
    again = cluster.client().chat.completions.with_raw_response.create(
        model=cluster.model, max_tokens=4, messages=[{"role": "system", "content": SHARED_PREFIX},
                                                     {"role": "user", "content": "another question"}])
    assert chat.headers[REPLICA] == again.headers[REPLICA]


def test_streaming_and_errors_as_a_single_server(cluster: Cluster) -> None:
    raw = cluster.client().chat.completions.with_raw_response.create(
        model=cluster.model, max_tokens=8, stream=True, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.headers[REPLICA]
    chunks = list(raw.parse())
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.NotFoundError) as not_found:
        cluster.client().completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        cluster.client().completions.create(model=cluster.model, prompt="hi", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    response = httpx.post(f"{cluster.base_url}/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_one_metrics_endpoint_shows_every_replica(cluster: Cluster) -> None:
    seen = {_complete(cluster, f"metrics probe {i} {'ab' * i}") for i in range(6)}
    deadline = time.monotonic() + 20
    while True:
        samples = _metrics(cluster)
        running = {s.labels["replica"] for s in samples.get("vllm:num_requests_running", [])}
        finished = {s.labels["replica"] for s in samples.get("vllm:generation_tokens", []) if s.value > 0}
        if (len(running) == 2 and seen <= finished) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(running) == 2 and seen <= finished, (running, finished, seen)
    assert all(s.labels["model_name"] == cluster.model for s in samples["vllm:num_requests_running"])


def test_killed_replica_fails_its_requests_and_the_other_serves(cluster: Cluster) -> None:
    prefix = "Story time, chapter one, the long road north. "   # a few blocks, so the stream follows the warm-up
    victim = _complete(cluster, prefix + "warm up")
    actor = ray.get_actor(victim, namespace="serve")
    stream = cluster.client().completions.create(model=cluster.model, prompt=prefix + "go on", max_tokens=180,
                                                 stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    ray.kill(actor, no_restart=True)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="died"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    # New requests go to the surviving replica, the prefix's one included, while Ray replaces the dead one.
    for i in range(3):
        assert _complete(cluster, prefix + f"after the kill {i}") != victim
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = serve.status().applications["conveyor"].deployments["ConveyorEngine"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    assert status.replica_states.get("RUNNING", 0) == 2, status
