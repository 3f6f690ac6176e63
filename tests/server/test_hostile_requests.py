"""Each request's cost is bounded before the work: tenant names, stop lists, message counts and
logprobs past their limits are 400s in our words, /metrics stays small whatever tenants clients
name, and a big response is built while /health still answers."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from server_helpers import RunningServer

from conveyor.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from conveyor.server.metrics import MAX_TENANT_LABEL_CHARS, tenant_label
from conveyor.server.http.request_limits import MAX_CHAT_MESSAGES, MAX_CHOICES_PER_REQUEST, MAX_TENANT_CHARS

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server: RunningServer, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("body,param,words", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", "at most"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop", "characters"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", "at most"),
    ({"user": "u" * (MAX_TENANT_CHARS + 1)}, "user", "tenant name"),
    ({"n": 16, "max_tokens": 200, "logprobs": 20}, "logprobs", "logprob entries"),
    ({"prompt": ["hi"] * (MAX_CHOICES_PER_REQUEST + 1)}, "prompt", "choices"),
    ({"prompt": ["hi"] * 100, "n": 100}, "n", "choices"),
])
def test_completion_limits_are_400s(tiny_server: RunningServer, body: dict, param: str, words: str) -> None:
    error = error_of(post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body}))
    assert error["param"] == param and words in error["message"], error


def test_chat_limits_are_400s(tiny_server: RunningServer) -> None:
    error = error_of(post(tiny_server, "/v1/chat/completions", {
        **CHAT, "messages": [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)}))
    assert error["param"] == "messages" and f"at most {MAX_CHAT_MESSAGES} messages" in error["message"], error
    too_many = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    error = error_of(post(tiny_server, "/tokenize", {"messages": too_many}))
    assert f"at most {MAX_CHAT_MESSAGES} messages" in error["message"], error
    error = error_of(post(tiny_server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20,
                                                                    "n": 16, "max_tokens": 200}))
    assert error["param"] == "top_logprobs" and "logprob entries" in error["message"], error
    error = error_of(post(tiny_server, "/v1/chat/completions", CHAT, **{"X-Tenant": "t" * (MAX_TENANT_CHARS + 1)}))
    assert "X-Tenant" in error["message"], error


def test_limits_themselves_are_served(tiny_server: RunningServer) -> None:
    response = post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": "u" * MAX_TENANT_CHARS,
                                                     "stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS})
    assert response.status_code == 200, response.text


def test_tenant_labels_are_short_and_plain() -> None:
    assert tenant_label("team-a.prod_1") == "team-a.prod_1"
    labels = {tenant_label(name) for name in ("x" * 200, "x" * 200 + "y", 'a"b\nc{}', "é" * 10)}
    assert len(labels) == 4
    for label in labels:
        assert len(label) <= MAX_TENANT_LABEL_CHARS and re.fullmatch(r"[A-Za-z0-9._-]+", label), label


def test_metrics_stay_small_whatever_tenants_are_named(tiny_server: RunningServer) -> None:
    for i in range(3):
        tenant = f'{i}"}}\n' + "z" * (MAX_TENANT_CHARS - 5)
        response = post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": tenant})
        assert response.status_code == 200, response.text
    text = httpx.get(f"{tiny_server.base_url}/metrics", timeout=10).text
    tenants = set(re.findall(r'tenant="([^"]*)"', text))
    assert tenants and all(len(t) <= MAX_TENANT_LABEL_CHARS for t in tenants), tenants
    assert "z" * (MAX_TENANT_LABEL_CHARS + 1) not in text and len(text) < 1_000_000


def test_health_answers_while_a_big_response_is_built(tiny_server: RunningServer) -> None:
    body = {"prompt": "hi", "max_tokens": 200, "n": 15, "logprobs": 20, "ignore_eos": True, "temperature": 1.0}
    result: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: result.append(post(tiny_server, "/v1/completions", body)))
    worker.start()
    slowest_s = 0.0
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        while worker.is_alive():
            began = time.monotonic()
            assert http.get("/health").status_code == 200
            slowest_s = max(slowest_s, time.monotonic() - began)
            time.sleep(0.05)
    worker.join()
    assert result[0].status_code == 200, result[0].text
    choices = result[0].json()["choices"]
    assert len(choices) == 15 and all(len(c["logprobs"]["top_logprobs"]) == 200 for c in choices)
    assert slowest_s < 1.0, slowest_s
