"""A server with --prefix-cache-host-size: a prompt whose blocks left the KV cache is served from host
memory, and /metrics counts those hits, the bytes copied each way and the bytes held."""

from __future__ import annotations

from pathlib import Path

import openai
from server_helpers import metrics, start_server

PROMPT = "def parse(line):\n    fields = line.split(',')\n    return {k: v for k, v in zip(KEYS, fields)}\n" * 2
OTHER = "class Ledger:\n    def add(self, berth, cargo):\n        self.rows.append((berth, cargo))\n" * 2
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def complete(client: openai.OpenAI, model: str, prompt: str) -> list[str]:
    return client.completions.create(model=model, prompt=prompt, logprobs=1, **GREEDY).choices[0].logprobs.tokens


def test_host_hits_and_bytes_in_metrics(tiny_checkpoint: Path) -> None:
    server = start_server(tiny_checkpoint, num_kv_blocks=12, kv_cache_dtype="float16",
                          prefix_cache_host_size="64MiB")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        cold = complete(client, server.model_name, PROMPT)
        complete(client, server.model_name, OTHER)   # evicts the first prompt's blocks from the KV cache
        warm = complete(client, server.model_name, PROMPT)
        values = metrics(server.base_url)
        host = server.engine.core.prefix_tier.host
    finally:
        server.stop()
    assert warm == cold
    hits = values["conveyor:prefix_cache_host_hits_total"]
    assert values["conveyor:prefix_cache_host_queries_total"] >= hits >= 16
    assert values["conveyor:prefix_cache_host_read_bytes_total"] == hits // 16 * host.block_nbytes
    assert values["conveyor:prefix_cache_host_written_bytes_total"] >= values["conveyor:prefix_cache_host_bytes"]
    assert values["conveyor:prefix_cache_host_bytes"] == host.nbytes > 0
    assert values["vllm:external_prefix_cache_hits_total"] == 0   # no disk
