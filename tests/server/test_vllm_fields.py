"""vLLM's extra request fields, each with its effect, through the `openai` client (extra_body) and raw HTTP."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_helpers import RunningServer, start_server

from conveyor.runtime.token_filters import apply_token_filters
from conveyor.sampling_params import SamplingParams

IM_START = 1   # the tiny tokenizer's <|im_start|>: a special token


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def _ids(choice) -> list[int]:
    """A completion choice's generated token ids, from return_tokens_as_token_ids logprobs."""
    return [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]


def _complete(client: openai.OpenAI, server: RunningServer, **fields):
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, **fields.pop("extra_body", {})}
    return client.completions.create(model=server.model_name, logprobs=0, extra_body=extra, **fields).choices[0]


def test_allowed_token_ids_and_token_ids_in_logprobs(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    allowed = [40, 41, 97]
    choice = _complete(client, tiny_server, prompt="hello", max_tokens=12, temperature=1.5, seed=3,
                       extra_body={"allowed_token_ids": allowed})
    ids = _ids(choice)
    assert len(ids) == 12 and set(ids) <= set(allowed) and len(set(ids)) > 1
    assert all(token.startswith("token_id:") for top in choice.logprobs.top_logprobs for token in top)
    chat = client.chat.completions.create(
        model=tiny_server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=1, extra_body={"allowed_token_ids": [97], "return_tokens_as_token_ids": True})
    assert [e.token for e in chat.choices[0].logprobs.content] == ["token_id:97"] * 3


def test_bad_words_are_never_written(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    tokenizer = tiny_server.engine.tokenizer
    free = _ids(_complete(client, tiny_server, prompt="the quick brown", max_tokens=10, temperature=0))
    word = tokenizer.decode([free[0]]).strip()
    assert word, "the greedy text starts with a word"
    banned = {ids[-1] for ids in (tokenizer.encode(word), tokenizer.encode(" " + word)) if len(ids) == 1}
    held = _ids(_complete(client, tiny_server, prompt="the quick brown", max_tokens=10, temperature=0,
                          extra_body={"bad_words": [word]}))
    assert held != free
    assert not banned & set(held) if banned else word not in tokenizer.decode(held)


def test_bad_word_of_several_tokens_blocks_its_last_after_the_rest() -> None:
    logits = torch.zeros(3, 8)
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=[[5, 6], [7]])
    outputs = [[1, 5], [5, 1], []]
    filtered = apply_token_filters(logits, [params] * 3, outputs)
    assert torch.isinf(filtered[0, 6]) and not torch.isinf(filtered[1, 6]) and not torch.isinf(filtered[2, 6])
    assert torch.isinf(filtered[:, 7]).all() and not torch.isinf(logits).any()


def test_truncate_prompt_tokens_keeps_the_last(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    prompt = tiny_server.engine.tokenizer.encode("one two three four five six seven")
    kept = client.completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True})
    tail = client.completions.create(model=tiny_server.model_name, prompt=prompt[-3:], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert kept.usage.prompt_tokens == 3 and kept.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=tiny_server.model_name, max_tokens=1,
                                          messages=[{"role": "user", "content": "a long question " * 5}],
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_special_tokens_in_text(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    """skip_special_tokens and spaces_between_special_tokens, on an output of <|im_start|> and a word."""
    tokenizer = tiny_server.engine.tokenizer
    word_id = next(i for i in range(3, 300) if tokenizer.decode([i]).isalpha() and len(tokenizer.decode([i])) > 2)
    word = tokenizer.decode([word_id])
    fields = dict(prompt="hello", max_tokens=12, temperature=100, seed=1)
    texts = {}
    for skip, spaces in ((True, False), (False, False), (False, True)):
        choice = _complete(client, tiny_server, **fields, extra_body={
            "allowed_token_ids": [IM_START, word_id], "skip_special_tokens": skip,
            "spaces_between_special_tokens": spaces})
        assert {IM_START, word_id} == set(_ids(choice))
        texts[skip, spaces] = choice.text
    assert texts[True, False] == word * _ids(choice).count(word_id)
    assert "<|im_start|>" in texts[False, False] and " <|im_start|>" not in texts[False, False].replace(" " + word, "")
    assert texts[False, True] != texts[False, False]
    assert texts[False, True].replace(" ", "") == texts[False, False].replace(" ", "")


@pytest.fixture(scope="module")
def bos_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model with a tokenizer that adds BOS to a text, as Llama's and Gemma's do."""
    folder = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_checkpoint, folder)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "add_bos_token": True}))
    running = start_server(folder, max_num_seqs=2)
    yield running
    running.stop()


def test_add_special_tokens(bos_server: RunningServer) -> None:
    url = bos_server.base_url
    base = len(bos_server.engine.tokenizer.encode("hello there", add_special_tokens=False))

    def prompt_tokens(path: str, body: dict) -> int:
        response = httpx.post(f"{url}{path}", json={"max_tokens": 1, **body}, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("/v1/completions", {"prompt": "hello there"}) == base + 1
    assert prompt_tokens("/v1/completions", {"prompt": "hello there", "add_special_tokens": False}) == base
    messages = [{"role": "user", "content": "hi"}]
    plain = prompt_tokens("/v1/chat/completions", {"messages": messages})
    assert prompt_tokens("/v1/chat/completions", {"messages": messages, "add_special_tokens": True}) == plain + 1


def test_json_body_sent_as_a_form_is_read_as_json(tiny_server: RunningServer) -> None:
    """`curl -d '{...}'` without -H 'Content-Type: application/json'."""
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        response = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=30, headers={
            "content-type": content_type}, content=json.dumps({"prompt": "hi", "max_tokens": 2}))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("fields,param", [
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
])
def test_vllm_field_refusals(tiny_server: RunningServer, fields: dict, param: str) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json={"prompt": "hi", **fields}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
