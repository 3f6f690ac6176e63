"""/tokenize, /detokenize and /v1/models/{id} on a real server, in vLLM's shapes."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import API_KEY, RunningServer


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def post(server: RunningServer, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30, **kwargs)


def test_tokenize_gives_the_tokens_a_completion_runs(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    text = "the quick brown fox"
    got = post(tiny_server, "/tokenize", {"prompt": text, "model": tiny_server.model_name}).json()
    completion = client.completions.create(model=tiny_server.model_name, prompt=text, max_tokens=1)
    assert got["count"] == len(got["tokens"]) == completion.usage.prompt_tokens
    assert got["max_model_len"] == tiny_server.engine.max_model_len
    assert post(tiny_server, "/tokenize", {"content": text}).json()["tokens"] == got["tokens"]   # llama-server's name
    back = post(tiny_server, "/detokenize", {"tokens": got["tokens"]}).json()
    assert back["prompt"] == back["content"] and text in back["prompt"]


def test_tokenize_chat_messages(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    got = post(tiny_server, "/tokenize", {"messages": messages}).json()
    chat = client.chat.completions.create(model=tiny_server.model_name, messages=messages, max_tokens=1)
    assert got["count"] == chat.usage.prompt_tokens


def test_bad_input_gets_clear_errors(tiny_server: RunningServer) -> None:
    both = post(tiny_server, "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 400 and "exactly one of" in both.json()["error"]["message"]
    assert post(tiny_server, "/tokenize", {}).status_code == 400
    outside = post(tiny_server, "/detokenize", {"tokens": [1, 10**9]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert post(tiny_server, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(tiny_server, "/detokenize", {"tokens": [True]}).status_code == 400   # not coerced to 1
    assert post(tiny_server, "/tokenize", {"prompt": "a", "add_special_tokens": "yes"}).status_code == 400
    wrong = post(tiny_server, "/tokenize", {"prompt": "a", "model": "nope"})
    assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "not_found_error"


def test_model_by_id(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    model = client.models.retrieve(tiny_server.model_name)
    assert model.id == tiny_server.model_name and model.model_extra["max_model_len"] == tiny_server.engine.max_model_len
    missing = httpx.get(f"{tiny_server.base_url}/v1/models/nope", timeout=10)
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]


def test_tokenize_needs_the_key(keyed_server: RunningServer) -> None:
    assert post(keyed_server, "/tokenize", {"prompt": "a"}).status_code == 401
    assert post(keyed_server, "/detokenize", {"tokens": [1]}).status_code == 401
    ok = post(keyed_server, "/tokenize", {"prompt": "a"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["count"] >= 1


def test_image_parts_get_one_clear_sentence(tiny_server: RunningServer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]
    for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                       ("/tokenize", {"messages": messages})):
        response = post(tiny_server, path, body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "'image_url' are not supported by this model" in error["message"], error
        assert "more problems" not in error["message"]


def test_embeddings_say_why_not(tiny_server: RunningServer) -> None:
    response = post(tiny_server, "/v1/embeddings", {"input": "hello", "model": tiny_server.model_name})
    assert response.status_code == 404
    assert "embeddings" in response.json()["error"]["message"]
