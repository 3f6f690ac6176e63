"""16 concurrent streaming greedy clients on the real default model: each gets what it gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from server_helpers import RunningServer, metrics, start_server

pytest.importorskip("gguf")

# Short raw prompts keep the sixteen one-at-a-time reference runs cheap on a CPU.
PROMPTS = [
    "The capital of France is", "Water is made of", "The sky is blue because", "Once upon a time",
    "def add(a, b):", "The three primary colours are", "My favourite fruit is", "In 1969, astronauts",
    "The opposite of hot is", "Bees make", "A spider has", "The largest ocean is",
    "To bake bread you need", "Python is a", "The sun rises in the", "Cats like to",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def real_server() -> Iterator[RunningServer]:
    running = start_server(None, max_num_seqs=16, kv_cache_memory="128MiB")
    yield running
    running.stop()


def test_16_concurrent_streaming_clients_match_each_alone(real_server: RunningServer) -> None:
    base_url = f"{real_server.base_url}/v1"
    model = real_server.model_name

    async def stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        parts = []
        finish = None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "length"
        return "".join(parts)

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(stream_one(client, p) for p in PROMPTS))

    steps_before = real_server.engine.stats.num_steps
    rows_before = real_server.engine.stats.num_rows
    concurrent = asyncio.run(together())
    steps = real_server.engine.stats.num_steps - steps_before
    rows = real_server.engine.stats.num_rows - rows_before
    assert rows / steps > 4, "the clients were not batched together"

    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
    alone = []
    for prompt in PROMPTS:
        result = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
        alone.append(result.choices[0].text)
    mismatches = [(p, c, a) for p, c, a in zip(PROMPTS, concurrent, alone, strict=True) if c != a]
    assert not mismatches, f"concurrent output differs from alone: {mismatches}"
    assert "Paris" in alone[0]
    values = metrics(real_server.base_url)
    assert values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0.0
