"""A real server with n-gram speculation: the same completions as without it, streamed or not, and
its drafts counted in /metrics under vLLM's spec_decode names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_helpers import RunningServer, metrics, start_server

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["the quick brown fox the quick brown fox the quick brown fox the quick",
           "one two three one two three one two three one two", "hello world"]


@pytest.fixture(scope="module")
def spec_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=4, speculative="ngram", num_speculative_tokens=3,
                           ngram_prompt_lookup_min=1)
    yield running
    running.stop()


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_same_completions_as_without_speculation(spec_server: RunningServer, tiny_server: RunningServer) -> None:
    plain, spec = client_for(tiny_server), client_for(spec_server)
    for prompt in PROMPTS:
        want = plain.completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=24, logprobs=1,
                                        **GREEDY)
        got = spec.completions.create(model=spec_server.model_name, prompt=prompt, max_tokens=24, logprobs=1,
                                      **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens == 24
        chunks = spec.completions.create(model=spec_server.model_name, prompt=prompt, max_tokens=24, stream=True,
                                         **GREEDY)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text


def test_drafts_are_counted(spec_server: RunningServer) -> None:
    spec = client_for(spec_server)
    spec.completions.create(model=spec_server.model_name, prompt=PROMPTS[0], max_tokens=24, **GREEDY)
    values = metrics(spec_server.base_url)
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= values["vllm:spec_decode_num_drafts_total"]
    accepted = values["vllm:spec_decode_num_accepted_tokens_total"]
    assert accepted > 0 and values["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
