"""Hostile structured-output constraints through a real server on the bundled model: a regex no token
of the vocabulary can open is a 400, one that reaches such a point mid-output stops there (never a
500, whatever sampling options are beside it), constraints past the size limits are refused at once,
and a compile past the time limit is a 400 while other requests and /health go on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_helpers import RunningServer, sse_events, start_server

from conveyor.config import GrammarLimits

pytest.importorskip("gguf")
pytest.importorskip("xgrammar")

# The bundled vocabulary has no token holding the bytes 0x13 or 0x14 (nor 0x04): text needing them
# cannot be written, though the regex compiles.
CANNOT_START = "\x14\x13?"
STOPS_AFTER_B = "b\x13\u00e9"
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "min_p": 0.5}, {"temperature": 1.0, "top_k": 3, "top_p": 0.5},
            {"temperature": 0, "logprobs": 2}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(None, max_num_seqs=4, kv_cache_memory="64MiB", server_options={
        "grammar": GrammarLimits(timeout_s=1.0, max_choices=1000)})
    yield running
    running.stop()


def post(server: RunningServer, path: str, body: dict, timeout_s: float = 60) -> httpx.Response:
    # json.dumps keeps control characters escaped, as a client's JSON encoder does.
    return httpx.post(f"{server.base_url}/v1/{path}", content=json.dumps(body), timeout=timeout_s,
                      headers={"Content-Type": "application/json"})


def completion(prompt: str = "hi", **fields: object) -> dict:
    return {"prompt": prompt, "max_tokens": 8, **fields}


def chat(**fields: object) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}


def test_a_regex_no_token_can_open_is_a_400(server: RunningServer) -> None:
    for path, body in (("completions", completion(guided_regex=CANNOT_START, min_p=0.5, temperature=1.0)),
                       ("chat/completions", chat(guided_regex=CANNOT_START, logprobs=True, top_logprobs=2))):
        response = post(server, path, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "guided_regex"
        assert "no text this model's tokens can write" in response.json()["error"]["message"]


@pytest.mark.parametrize("sampling", SAMPLING)
def test_a_regex_that_reaches_a_dead_end_stops_there_and_never_500s(server: RunningServer, sampling: dict) -> None:
    response = post(server, "completions", completion(guided_regex=STOPS_AFTER_B, **sampling))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "b" and choice["finish_reason"] == "stop"
    chat_sampling = {k: v for k, v in sampling.items() if k != "logprobs"}
    response = post(server, "chat/completions", chat(guided_regex=STOPS_AFTER_B, **chat_sampling))
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]
    assert message["message"]["content"] == "b" and message["finish_reason"] == "stop"


def test_a_dead_end_in_a_stream_ends_the_stream_cleanly(server: RunningServer) -> None:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json=completion(guided_regex=STOPS_AFTER_B, stream=True, logprobs=1)) as response:
        assert response.status_code == 200
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [event for event in events[:-1] if isinstance(event, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == "b"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "stop"


def test_constraints_past_the_size_limits_are_refused_at_once(server: RunningServer) -> None:
    huge_enum = {"type": "object", "properties": {"pick": {"enum": [f"v{i}" for i in range(50_000)]}}}
    cases = [
        ("completions", completion(guided_json=huge_enum), "--max-grammar-bytes"),
        ("completions", completion(guided_choice=[f"c{i}" for i in range(5000)]), "--max-grammar-choices"),
        ("chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
            "name": "pick", "schema": {"enum": list(range(1001))}}}), "--max-grammar-choices"),
        ("completions", completion(guided_regex="a" * 5000), "--max-regex-chars"),
        ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"x": {"enum": list(range(5000))}}}}}]), "--max-grammar-choices"),
    ]
    for path, body, flag in cases:
        started = time.monotonic()
        response = post(server, path, body)
        assert response.status_code == 400, response.text
        assert flag in response.json()["error"]["message"]
        assert time.monotonic() - started < 10   # refused before any compile (which took minutes)


def test_a_compile_past_the_time_limit_is_a_400_while_the_rest_goes_on(server: RunningServer) -> None:
    gate = server.server.config.app.state.serving.grammar_gate
    release = threading.Event()
    original = gate.compiler
    real_compile = original.compile

    class SlowOnOne:
        vocab_size, is_built = original.vocab_size, True

        def compile(self, spec, param="structured_outputs"):
            if spec.regex == "[0-9]{3}-slow":
                release.wait(30)
            return real_compile(spec, param)

    gate.compiler = SlowOnOne()
    try:
        started = time.monotonic()
        response = post(server, "completions", completion(guided_regex="[0-9]{3}-slow"))
        assert response.status_code == 400 and "--grammar-timeout" in response.json()["error"]["message"]
        assert time.monotonic() - started < 10
        # Its thread is still busy; the other thread, plain requests and /health are not.
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert post(server, "completions", completion(max_tokens=2)).status_code == 200
        assert post(server, "completions", completion(response_format={"type": "json_object"},
                                                     max_tokens=4)).status_code == 200
        again = post(server, "completions", completion(guided_regex="[0-9]{3}-slow"))
        assert again.status_code == 400 and "--grammar-timeout" in again.json()["error"]["message"]
    finally:
        release.set()
        gate.compiler = original
