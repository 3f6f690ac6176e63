"""n choices per prompt through a real server: each with its own index, streamed or not, seeded ones
reproducible and different from each other, the prompt computed once (the prefix cache serves the
other choices), and batches of prompts numbered as OpenAI numbers them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_helpers import RunningServer, metrics, start_server

PROMPT = "the quick brown fox jumps over the lazy dog " * 4


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=8)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_n_seeded_choices_differ_are_reproducible_and_share_the_prompt(server: RunningServer,
                                                                        client: openai.OpenAI) -> None:
    before = metrics(server.base_url)
    first = client.completions.create(model=server.model_name, prompt=PROMPT, n=4, max_tokens=12, seed=5,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    after = metrics(server.base_url)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 4 * 12
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits >= 3 * 32   # the three later choices found the prompt's full blocks cached
    again = client.completions.create(model=server.model_name, prompt=PROMPT, n=4, max_tokens=12, seed=5,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    one = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, seed=5, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == first.choices[0].text   # choice 0 is the request's own seed


def test_streamed_chat_choices_carry_their_index(server: RunningServer, client: openai.OpenAI) -> None:
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.chat.completions.create(model=server.model_name, n=3, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "hello"}], stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert texts[0] == texts[1] == texts[2]   # greedy: the same answer three times


def test_a_batch_of_prompts_times_n_is_numbered_prompt_by_prompt(server: RunningServer,
                                                                 client: openai.OpenAI) -> None:
    response = client.completions.create(model=server.model_name, prompt=["hello world", "the sky is"], n=2,
                                         max_tokens=5, temperature=0)
    by_index = {c.index: c.text for c in response.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]
    alone = client.completions.create(model=server.model_name, prompt="the sky is", max_tokens=5, temperature=0)
    assert by_index[2] == alone.choices[0].text
