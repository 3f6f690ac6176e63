"""Every refusal has its status and OpenAI error body; none of them hurts the next request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import API_KEY, RunningServer, metrics, slow_steps, sse_events, start_server, wait_for


def post(server: RunningServer, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=30, **kwargs)  # type: ignore[arg-type]


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None = None,
                 code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["param"] == param and error["code"] == code, error
    assert error["message"]
    return error


def test_malformed_json(tiny_server: RunningServer) -> None:
    response = post(tiny_server, "/v1/completions", content=b'{"prompt": "hi",',
                    headers={"content-type": "application/json"})
    error = assert_error(response, 400, "invalid_request_error")
    assert "JSON" in error["message"]


def test_body_that_is_not_an_object(tiny_server: RunningServer) -> None:
    assert_error(post(tiny_server, "/v1/chat/completions", json=[1, 2]), 400, "invalid_request_error")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3},
     "presence_penalty"),
])
def test_invalid_field_names_param(tiny_server: RunningServer, path: str, body: dict, param: str) -> None:
    assert_error(post(tiny_server, path, json=body), 400, "invalid_request_error", param=param)


def test_unknown_fields_are_refused_by_name_and_null_ones_pass(tiny_server: RunningServer) -> None:
    """A field the server would ignore is a 400: the client's code is wrong, and it is told so."""
    response = post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {},
                                                          "some_future_field": [1]})
    assert_error(response, 400, "invalid_request_error", param="some_future_field")
    response = post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {},
                                                          "some_future_field": None})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 1000}),
    ("/v1/completions", {"prompt": [[5] * 300]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}]}),
])
def test_context_length_exceeded(tiny_server: RunningServer, path: str, body: dict) -> None:
    response = post(tiny_server, path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert "256" in error["message"]  # names the model length


def test_context_length_exceeded_when_streaming(tiny_server: RunningServer) -> None:
    response = post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 1000, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model(tiny_server: RunningServer) -> None:
    response = post(tiny_server, "/v1/chat/completions", json={"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}]})
    error = assert_error(response, 404, "not_found_error", param="model", code="model_not_found")
    assert "gpt-9" in error["message"]
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")


def test_unknown_route_has_an_openai_body(tiny_server: RunningServer) -> None:
    response = httpx.get(f"{tiny_server.base_url}/v1/nothing-here")
    assert_error(response, 404, "not_found_error")


def test_body_too_large(tiny_server: RunningServer) -> None:
    huge = json.dumps({"prompt": "x" * (2 * 1024 * 1024)}).encode()
    # Declared by Content-Length: refused before the body is read.
    response = post(tiny_server, "/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error", code="request_too_large")

    # Chunked, with no Content-Length: refused once the bytes read pass the limit.
    def chunks() -> Iterator[bytes]:
        for start in range(0, len(huge), 64 * 1024):
            yield huge[start:start + 64 * 1024]

    response = post(tiny_server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error", code="request_too_large")
    assert post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key(keyed_server: RunningServer) -> None:
    url = f"{keyed_server.base_url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 2}
    missing = httpx.post(url, json=body)
    assert_error(missing, 401, "authentication_error", code="invalid_api_key")
    assert missing.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401,
                 "authentication_error", code="invalid_api_key")
    assert_error(httpx.get(f"{keyed_server.base_url}/v1/models"), 401, "authentication_error",
                 code="invalid_api_key")
    # Refused before the body is parsed: a malformed body without a key is still a 401.
    assert httpx.post(url, content=b"{", headers={"content-type": "application/json"}).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.base_url}/metrics").status_code == 200

    good = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=keyed_server.model_name, prompt="hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=keyed_server.model_name, messages=[{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def queue_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    """One sequence per batch and one waiting slot, so a third request finds the queue full."""
    running = start_server(tiny_checkpoint, max_num_seqs=1, max_waiting_requests=1)
    yield running
    running.stop()


def test_queue_full_is_429_while_others_are_served(queue_server: RunningServer) -> None:
    base = queue_server.base_url
    long_body = {"prompt": "the quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=long_body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass  # the first token: this request holds the only batch slot
                waiting = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": "hello", "max_tokens": 5, "ignore_eos": True}))
                await asyncio.to_thread(wait_for, lambda: metrics(base)["vllm:num_requests_waiting"] == 1,
                                        10.0, "the second request to wait")
                refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert_error(refused, 429, "rate_limit_error", code="queue_full")
                assert int(refused.headers["retry-after"]) >= 1
                refused_stream = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "stream": True})
                assert refused_stream.status_code == 429 and "retry-after" in refused_stream.headers
                assert (await http.get("/health")).status_code == 200
                assert (await http.get("/v1/models")).status_code == 200
            # Leaving the stream aborts the running request; the waiting one runs and finishes.
            second = await waiting
            assert second.status_code == 200, second.text
            assert second.json()["choices"][0]["finish_reason"] == "length"
            after = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert after.status_code == 200

    with slow_steps(queue_server.engine, 0.01):
        asyncio.run(scenario())


def test_failed_step_is_a_500_and_the_server_goes_on(tiny_server: RunningServer) -> None:
    runner = tiny_server.engine.runner
    original = runner.execute
    failures = []

    def execute_failing_once(plan):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(plan)
            raise RuntimeError("injected fault")
        return original(plan)

    runner.execute = execute_failing_once  # type: ignore[method-assign]
    try:
        response = post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        error = assert_error(response, 500, "internal_error")
        assert "injected fault" in error["message"]
        assert post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200

        failures.clear()
        with httpx.stream("POST", f"{tiny_server.base_url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as stream:
            assert stream.status_code == 200
            events = sse_events(list(stream.iter_lines()))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "internal_error" and "injected fault" in events[-2]["error"]["message"]

        failures.clear()
        client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="injected fault"):
            for _ in client.completions.create(model=tiny_server.model_name, prompt="hi", max_tokens=4,
                                               stream=True):
                pass
    finally:
        del runner.execute
    assert post(tiny_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
    assert metrics(tiny_server.base_url)["vllm:num_requests_running"] == 0
