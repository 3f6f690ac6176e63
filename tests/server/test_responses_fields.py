"""The Responses API's `include`, `top_logprobs` and `reasoning` fields through a real server and the official
openai client: output_text logprobs equal to the chat path's (plain and streamed), the effort mapping (with a
reasoning parser: test_reasoning_server.py), what cannot be honoured refused by name; and stored responses
kept in an SQLite file that two servers share (a follow-up landing on the other one)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import RunningServer, start_server
from test_errors import assert_error

from conveyor.errors import InvalidRequest
from conveyor.server.openai_api.chat_output import EFFORT_BUDGETS, effort_settings

ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0)


def test_output_text_logprobs_are_the_chat_paths(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    response = client.responses.create(model=tiny_server.model_name, input=ASK, max_output_tokens=6, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2)
    chat = client.chat.completions.create(model=tiny_server.model_name, messages=[{"role": "user", "content": ASK}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    part = response.output[0].content[0]
    expected = chat.choices[0].logprobs.content
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [(lp.token, lp.logprob) for lp in expected]
    assert [[t.token for t in lp.top_logprobs] for lp in part.logprobs] == \
        [[t.token for t in lp.top_logprobs] for lp in expected]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert response.top_logprobs == 2 and response.include == ["message.output_text.logprobs"]

    events = list(client.responses.create(model=tiny_server.model_name, input=ASK, max_output_tokens=6,
                                          temperature=0, include=["message.output_text.logprobs"], top_logprobs=2,
                                          stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == len(part.logprobs)

    plain = client.responses.create(model=tiny_server.model_name, input=ASK, max_output_tokens=6, temperature=0)
    assert plain.output[0].content[0].logprobs is None and plain.output_text == response.output_text


@pytest.mark.parametrize(("body", "param"), [
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include.1"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),    # no --reasoning-parser on this server
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
])
def test_what_cannot_be_honoured_is_refused(tiny_server: RunningServer, body: dict, param: str) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/responses", json={"input": "hi", **body}, timeout=30)
    assert_error(response, 400, "invalid_request_error", param=param)


def test_effort_mapping() -> None:
    assert effort_settings(None, "qwen3", {"x": 1}, 7) == ({"x": 1}, 7)
    assert effort_settings("none", "qwen3", None, None) == (
        {"reasoning_effort": "none", "enable_thinking": False}, 0)
    assert effort_settings("low", "qwen3", None, None) == ({"reasoning_effort": "low"}, EFFORT_BUDGETS["low"])
    assert effort_settings("high", "deepseek_r1", None, None) == ({"reasoning_effort": "high"}, None)
    # What the request sets itself wins.
    assert effort_settings("minimal", "qwen3", {"enable_thinking": True}, 5) == (
        {"reasoning_effort": "minimal", "enable_thinking": True}, 5)
    assert effort_settings("none", None, None, None) == ({"reasoning_effort": "none", "enable_thinking": False}, None)
    with pytest.raises(InvalidRequest):
        effort_settings("medium", None, None, None)


def test_two_servers_share_stored_responses(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    servers = [start_server(tiny_checkpoint, max_num_seqs=1, server_options={"responses_store": str(path)})
               for _ in range(2)]
    try:
        first, second = (openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0) for s in servers)
        name = servers[0].model_name
        created = first.responses.create(model=name, input="My name is Ada.", max_output_tokens=3, temperature=0)
        assert second.responses.retrieve(created.id).output_text == created.output_text
        follow = second.responses.create(model=name, input="What is my name?", previous_response_id=created.id,
                                         max_output_tokens=3, temperature=0)
        # The follow-up saw the first turn: its prompt is the whole conversation.
        alone = second.responses.create(model=name, input="What is my name?", max_output_tokens=3, temperature=0)
        assert follow.usage.input_tokens > alone.usage.input_tokens + 5
        assert first.responses.retrieve(follow.id).previous_response_id == created.id
        first.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            second.responses.retrieve(created.id)
    finally:
        for server in servers:
            server.stop()


def test_the_store_file_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    from conveyor.errors import NotFound
    from conveyor.server.openai_responses.store import ResponseStore

    path = tmp_path / "r.sqlite3"
    one, other = ResponseStore(path, max_stored=3), ResponseStore(path, max_stored=3)
    for i in range(3):
        one.put({"id": f"r{i}"}, [])
    other.get("r0")                      # used: r1 is now the least recently used
    other.put({"id": "r3"}, [])
    with pytest.raises(NotFound):
        one.get("r1")
    assert [one.get(f"r{i}")[0]["id"] for i in (0, 2, 3)] == ["r0", "r2", "r3"]
    small = ResponseStore(tmp_path / "s.sqlite3", max_bytes=300)
    for i in range(4):
        small.put({"id": f"s{i}"}, [{"role": "user", "content": "x" * 100}])
    with pytest.raises(NotFound):
        small.get("s0")
    assert small.get("s3")[0] == {"id": "s3"}
