"""The replicas' routing policy, prompt keys, HTTP bridge and metrics merge, without Ray."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from conveyor.replicas.config import ReplicaConfig
from conveyor.core.block_manager import hash_block
from conveyor.text.tokenizer_loader import load_tokenizer
from conveyor.replicas.http_bridge import REPLICA_HEADER, ForwardedRequest, call_app
from conveyor.replicas.metrics_merge import MetricsStore, merge_metrics
from conveyor.replicas.prompt_prefix import PromptPrefix
from conveyor.replicas.routing import PrefixTable, RoutingKey, prefix_key, rank_replicas


def test_prefix_key_chains_full_blocks_like_the_prefix_cache() -> None:
    tokens = list(range(40))
    key = prefix_key(tokens, block_size=16, max_blocks=4)
    first = hash_block(None, tokens[:16])
    assert key.block_hashes == (first, hash_block(first, tokens[16:32]))   # 40 tokens: two full blocks
    assert prefix_key(tokens[:15], block_size=16).block_hashes == ()
    assert len(prefix_key(list(range(200)), block_size=16, max_blocks=4).block_hashes) == 4


def test_table_finds_the_longest_recorded_prefix_and_forgets_dead_replicas() -> None:
    table = PrefixTable(capacity=100)
    short, longer = prefix_key(list(range(16)), 16), prefix_key(list(range(48)), 16)
    table.record(short, "a")
    assert table.lookup(longer) == "a"            # shares the first block
    table.record(longer, "b")
    assert table.lookup(longer) == "b" and table.lookup(short) == "b"
    assert table.lookup(prefix_key([7] * 32, 16)) is None
    table.forget({"a"})
    assert table.lookup(longer) is None


def test_table_is_bounded() -> None:
    table = PrefixTable(capacity=3)
    for i in range(10):
        table.record(RoutingKey((bytes([i]),)), "a")
    assert table.lookup(RoutingKey((bytes([0]),))) is None and table.lookup(RoutingKey((bytes([9]),))) == "a"


def test_ranks_prefer_the_prefix_replica_then_the_least_loaded() -> None:
    rng = random.Random(0)
    assert rank_replicas({"a": 3, "b": 0, "c": 0}, "a", imbalance=4, rng=rng)[0] == ["a"]
    ranks = rank_replicas({"a": 3, "b": 0, "c": 0}, None, rng=rng)
    assert sorted(ranks[0]) == ["b", "c"] and ranks[1] == ["a"]
    # too busy: the prefix's replica is passed over, and comes back in its load tier
    assert rank_replicas({"a": 20, "b": 0}, "a", imbalance=16, rng=rng) == [["b"], ["a"]]
    assert rank_replicas({"a": 20, "b": 0}, "a", sticky=True, imbalance=16, rng=rng)[0] == ["a"]
    assert rank_replicas({"b": 0}, "gone", rng=rng) == [["b"]]


def test_idle_replicas_share_the_work() -> None:
    rng = random.Random(1)
    firsts = {rank_replicas({"a": 0, "b": 0}, None, rng=rng)[0][0] for _ in range(20)}
    assert firsts == {"a", "b"}


def test_prompt_prefix_keys_match_for_a_shared_prefix(tiny_checkpoint: Path) -> None:
    prefix = PromptPrefix(load_tokenizer(tiny_checkpoint, None), block_size=4, max_blocks=2)
    shared = "The quick brown fox jumps over the lazy dog. " * 4

    def key(path: str, payload: object) -> RoutingKey:
        return prefix.key(path, json.dumps(payload).encode())

    one = key("/v1/completions", {"prompt": shared + "one"})
    assert one.block_hashes and one == key("/v1/completions", {"prompt": shared + "two, longer"})
    assert one != key("/v1/completions", {"prompt": "Something else entirely. " * 4})
    chat = key("/v1/chat/completions", {"messages": [{"role": "user", "content": shared + "a"}]})
    assert chat.block_hashes and chat == key("/v1/chat/completions",
                                             {"messages": [{"role": "user", "content": shared + "b"}]})
    assert key("/v1/completions", {"prompt": list(range(9))}) == prefix_key(list(range(9)), 4, 2)
    # unreadable bodies get no key: the replica answers them as a single server would
    assert prefix.key("/v1/completions", b"{not json") == RoutingKey()
    assert key("/v1/chat/completions", {"messages": "nope"}) == RoutingKey()
    assert prefix.key("/v1/completions", b"[" * 100_000 + b"]" * 100_000) == RoutingKey()   # too deep to parse
    assert key("/v1/batches", {}).sticky and key("/v1/files/x", {}).sticky


def test_replica_config_bounds() -> None:
    assert not ReplicaConfig(num_replicas=2).is_autoscaling
    config = ReplicaConfig(num_replicas=2, max_replicas=4)
    assert config.is_autoscaling and (config.lower_bound, config.upper_bound) == (1, 4)
    with pytest.raises(ValueError, match="between min_replicas and max_replicas"):
        ReplicaConfig(num_replicas=5, min_replicas=1, max_replicas=4)
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaConfig(num_replicas=0)


def _registry_text(value: float) -> str:
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "prompt tokens", ["model_name"], registry=registry).labels("m").inc(value)
    Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"], registry=registry,
              buckets=(0.1, 1.0)).labels("m").observe(0.5)
    return generate_latest(registry).decode()


def test_merged_metrics_label_every_sample_with_its_replica() -> None:
    merged = merge_metrics({"r1": _registry_text(3), "r2": _registry_text(5)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    prompt = {s.labels["replica"]: s.value for s in families["vllm:prompt_tokens"].samples
              if s.name.endswith("_total")}
    assert prompt == {"r1": 3.0, "r2": 5.0}
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert merged.count("# TYPE vllm:prompt_tokens_total counter") == 1


def test_metrics_store_drops_silent_replicas() -> None:
    now = [0.0]
    store = MetricsStore(stale_after_s=5, clock=lambda: now[0])
    store.push("a", "x")
    now[0] = 3.0
    store.push("b", "y")
    now[0] = 6.0
    assert store.texts() == {"b": "y"}


async def _echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body + scope["path"].encode(), "more_body": True})
    if body == b"wait":
        assert (await receive())["type"] == "http.disconnect"
        _disconnects.append(scope["path"])
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


_disconnects: list[str] = []


def test_call_app_relays_messages_and_tells_the_app_when_the_caller_left() -> None:
    async def run() -> tuple[list[Message], list[Message]]:
        request = ForwardedRequest("POST", "/p", b"", [], b"hi")
        done = [m for batch in [b async for b in call_app(_echo_app, request, "r1")] for m in batch]
        stream = call_app(_echo_app, ForwardedRequest("POST", "/w", b"", [], b"wait"), "r1")
        first = await anext(stream)
        await stream.aclose()          # as when Ray cancels the call
        await asyncio.sleep(0.05)
        return done, first

    done, first = asyncio.run(run())
    assert (REPLICA_HEADER, b"r1") in done[0]["headers"]
    assert b"".join(m.get("body", b"") for m in done) == b"hi/p"
    assert first[-1]["body"] == b"wait/w" and _disconnects == ["/w"]


def test_serve_flags_make_a_replica_config() -> None:
    from conveyor.cli.flags import parse_args, serve_configs

    assert serve_configs(parse_args(["serve"]))[2] is None
    _, server, replicas = serve_configs(parse_args(["serve", "--replicas", "3", "--max-replicas", "5",
                                                    "--ray-address", "auto", "--port", "9000"]))
    assert replicas == ReplicaConfig(num_replicas=3, max_replicas=5, ray_address="auto") and server.port == 9000
    _, _, replicas = serve_configs(parse_args(["serve", "--min-replicas", "2", "--max-replicas", "4"]))
    assert (replicas.num_replicas, replicas.lower_bound, replicas.upper_bound) == (2, 2, 4)
