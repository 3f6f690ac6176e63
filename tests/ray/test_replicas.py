"""`conveyor serve --replicas 2` on a local Ray cluster (loopback only): routing, API, metrics, a replica killed.

One cluster for the module (Ray and the deployment take ~15 s to start); the test that kills a
replica runs last.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]'): replica tests skipped")

import ray  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from conveyor.config import EngineConfig, ServerConfig  # noqa: E402
from conveyor.replicas.config import ReplicaConfig  # noqa: E402
from conveyor.replicas.launch import connect_ray, deploy  # noqa: E402

pytestmark = pytest.mark.ray
REPLICA = "x-conveyor-replica"
LONG_ANSWER = 6000
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
def cluster(tiny_checkpoint_factory: Callable[[str], Path]) -> Iterator[Cluster]:
    checkpoint = tiny_checkpoint_factory("llama_long")
    connect_ray(None, num_cpus=2, log_to_driver=False)
    # After Ray is up: its own processes take ephemeral ports as they start, and one picked before
    # could be gone by the time Serve's proxy binds it.
    port = _free_port()
    try:
        config = EngineConfig.from_options(model=str(checkpoint), threads=1, kv_cache_memory="64MiB",
                                           max_num_batched_tokens=512)
        server = ServerConfig(host="127.0.0.1", port=port, core_process=False, shutdown_grace_s=1.0)
        # Pushes far apart: what a scrape shows right after a request can only come from asking the replicas.
        deploy(config, server, ReplicaConfig(num_replicas=2, metrics_push_interval_s=30.0))
        yield Cluster(f"http://127.0.0.1:{port}", checkpoint.name)
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(cluster: Cluster, prompt: str, max_tokens: int = 4, ignore_eos: bool = False) -> str:
    raw = cluster.client().completions.with_raw_response.create(model=cluster.model, prompt=prompt,
                                                                max_tokens=max_tokens,
                                                                extra_body={"ignore_eos": ignore_eos})
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


def _successes(cluster: Cluster) -> dict[str, float]:
    by_replica: dict[str, float] = {}
    for sample in _metrics(cluster).get("vllm:request_success", []):
        if sample.name == "vllm:request_success_total":
            by_replica[sample.labels["replica"]] = by_replica.get(sample.labels["replica"], 0.0) + sample.value
    return by_replica


def test_a_scrape_returns_the_replicas_current_values(cluster: Cluster) -> None:
    """Right after the answers, one scrape counts every request on the replica that served it
    (pushes are 30 s apart here, so a merge of pushed copies would still show the old counts)."""
    before = _successes(cluster)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        served = list(pool.map(lambda i: _complete(cluster, f"count me {i} {'cd' * i}"), range(10)))
    after = _successes(cluster)
    assert {replica: after.get(replica, 0.0) - before.get(replica, 0.0) for replica in set(served)} == {
        replica: served.count(replica) for replica in set(served)}


def _replica_value(cluster: Cluster, sample_name: str, replica: str) -> float:
    return sum(s.value for samples in _metrics(cluster).values() for s in samples
               if s.name == sample_name and s.labels.get("replica") == replica)


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_client_leaving_mid_stream_aborts_its_request_on_the_replica(cluster: Cluster) -> None:
    prefix = "Disconnect check, a prompt several blocks long. "
    started = time.monotonic()
    replica = _complete(cluster, prefix + "warm up", max_tokens=180, ignore_eos=True)
    full_request_s = time.monotonic() - started
    finished = _replica_value(cluster, "vllm:e2e_request_latency_seconds_count", replica)
    assert finished > 0   # a scrape shows the replica's values as of the scrape
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", timeout=30,
                      json={"model": cluster.model, "prompt": prefix + "go on", "max_tokens": 180,
                            "ignore_eos": True, "stream": True}) as response:
        assert response.headers[REPLICA] == replica
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    # Had it gone on, the request would finish within twice a whole one's time, and count as finished.
    time.sleep(2 * full_request_s + 1.0)
    assert _replica_value(cluster, "vllm:num_requests_running", replica) == 0
    assert _replica_value(cluster, "vllm:e2e_request_latency_seconds_count", replica) == finished


def test_killed_replica_fails_its_requests_and_the_other_serves(cluster: Cluster) -> None:
    prefix = "Story time, chapter one, the long road north. "   # a few blocks, so the stream follows the warm-up
    victim = _complete(cluster, prefix + "warm up")
    actor = ray.get_actor(victim, namespace="serve")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # In flight on the victim too: one without streaming, whose response has not started. Both
        # answers take seconds (a 180-token one takes 0.15 s here: it could end before the kill).
        whole = pool.submit(_complete, cluster, prefix + "a whole answer", LONG_ANSWER, True)
        stream = cluster.client().completions.create(model=cluster.model, prompt=prefix + "go on",
                                                     max_tokens=LONG_ANSWER, stream=True,
                                                     extra_body={"ignore_eos": True})
        next(iter(stream))
        _wait_for(lambda: _replica_value(cluster, "vllm:num_requests_running", victim) == 2, 30,
                  "both requests running on one replica")
        ray.kill(actor, no_restart=True)
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="died"):
            for _ in stream:
                pass
        with pytest.raises(openai.InternalServerError, match="died") as failed:
            whole.result(timeout=30)
    assert failed.value.status_code == 503 and failed.value.body["type"] == "service_unavailable"
    assert time.monotonic() - started < 30
    # New requests go to the surviving replica, the prefix's one included, while Ray replaces the dead one.
    survivors = {_complete(cluster, prefix + f"after the kill {i}") for i in range(3)}
    assert victim not in survivors and len(survivors) == 1

    def replaced() -> bool:
        samples = _metrics(cluster).get("vllm:num_requests_running", [])
        return bool({s.labels["replica"] for s in samples} - survivors - {victim})

    _wait_for(replaced, 90, "Ray to start a replacement replica")
