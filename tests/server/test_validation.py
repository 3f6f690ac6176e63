"""Field ranges at the API edge: nonsense gets a 400 naming the field, never a 200, a 500 or a crash."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_helpers import RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def post_raw(server: RunningServer, path: str, raw: str) -> httpx.Response:
    """Send the JSON text as is: Infinity and lone surrogates cannot come out of json.dumps(..., allow_nan=False)."""
    return httpx.post(f"{server.base_url}{path}", content=raw.encode(), timeout=30,
                      headers={"content-type": "application/json"})


def assert_400(response: httpx.Response, param: str, code: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["code"] == code, error
    return error


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": [[False]]}, "prompt"),
    (COMPLETIONS, {"prompt": [True, 5]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "min_p": False}, "min_p"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": 1e308}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": 101}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_k": 1e9}, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "top_k": 2**40}, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**70}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "priority": 2**70}, "priority"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e300}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 5e-324}, "repetition_penalty"),   # logit / it = inf
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [1e12]}, "stop_token_ids.0"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**12]}, "stop_token_ids"),   # admission: the vocabulary
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [3, -1]}, "stop_token_ids"),     # SamplingParams: the range
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
    (CHAT, {"messages": HI, "seed": -(2**63) - 1}, "seed"),
    (CHAT, {"messages": HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_out_of_range_fields_name_the_field(tiny_server: RunningServer, path: str, body: dict, param: str) -> None:
    assert_400(httpx.post(f"{tiny_server.base_url}{path}", json=body, timeout=30), param)


@pytest.mark.parametrize("path,raw,param", [
    (COMPLETIONS, '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "top_p": NaN}', "top_p"),
    (COMPLETIONS, '{"prompt": "hi", "presence_penalty": -1e999}', "presence_penalty"),
    (COMPLETIONS, '{"prompt": "A \\ud800 B"}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "\\udfff"]}', "prompt"),
    (COMPLETIONS, '{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content"),
])
def test_non_finite_numbers_and_lone_surrogates(tiny_server: RunningServer, path: str, raw: str,
                                                param: str) -> None:
    error = assert_400(post_raw(tiny_server, path, raw), param)
    if "ud" in raw:
        assert "Unicode" in error["message"]


def test_valid_extremes_are_served(tiny_server: RunningServer) -> None:
    """The edges of each range are fine, including a top_p that rounds to 0 in float32."""
    for extra in ({"top_p": 1e-46}, {"top_p": 2.225e-311}, {"temperature": 100, "seed": 2**64 - 1},
                  {"top_k": 2**31 - 1, "seed": -(2**63), "priority": -(2**63)}, {"stop_token_ids": [0, 299]},
                  {"repetition_penalty": 100, "min_p": 1}, {"repetition_penalty": 0.01, "logprobs": 20}):
        # Sampled without a seed, a row may draw the end-of-text token: ignore_eos keeps every length
        # at 3, except where a stop token is asked for and drawn.
        response = httpx.post(f"{tiny_server.base_url}{COMPLETIONS}", timeout=30,
                              json={"prompt": "A", "max_tokens": 3, "ignore_eos": True, **extra})
        assert response.status_code == 200, (extra, response.text)
        body = response.json()
        if "stop_token_ids" in extra and body["choices"][0]["finish_reason"] == "stop":
            assert 1 <= body["usage"]["completion_tokens"] <= 3, body
        else:
            assert body["choices"][0]["finish_reason"] == "length", (extra, body)
            assert body["usage"]["completion_tokens"] == 3, (extra, body)


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": [[5] * 300], "max_tokens": 5}, "prompt"),
    (COMPLETIONS, {"prompt": "hello world", "max_tokens": 1000}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 400}], "max_tokens": 5}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 400}]}, "messages"),
    (CHAT, {"messages": HI, "max_completion_tokens": 1000}, "max_completion_tokens"),
])
def test_context_length_exceeded_names_the_culprit(tiny_server: RunningServer, path: str, body: dict,
                                                   param: str) -> None:
    response = httpx.post(f"{tiny_server.base_url}{path}", json=body, timeout=30)
    assert_400(response, param, code="context_length_exceeded")


def test_documented_ranges_are_in_the_openapi_document(tiny_server: RunningServer) -> None:
    schema = httpx.get(f"{tiny_server.base_url}/openapi.json", timeout=30).json()
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    text = json.dumps(fields)
    assert '"maximum": 100.0' in text and '"exclusiveMinimum": 0.0' in text
    assert "maximum" in json.dumps(fields["seed"]) and "maximum" in json.dumps(fields["priority"])


def test_a_bug_is_one_500_with_one_logged_traceback(tiny_server: RunningServer, monkeypatch, caplog) -> None:
    serving = tiny_server.server.config.app.state.serving

    async def broken(body, request):  # type: ignore[no-untyped-def]
        raise TypeError("injected bug")

    monkeypatch.setattr(serving, "completions", broken)
    with caplog.at_level("ERROR"):
        response = httpx.post(f"{tiny_server.base_url}{COMPLETIONS}", json={"prompt": "hi"}, timeout=30)
        time.sleep(0.5)   # the server logs a re-raised error only after the response went out
    assert response.status_code == 500, response.text
    assert response.json()["error"] == {"message": "internal server error: TypeError", "type": "internal_error",
                                        "param": None, "code": None}
    tracebacks = [r for r in caplog.records if r.exc_info and "injected bug" in str(r.exc_info[1])]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
