"""The OpenAI-compatible endpoints through the real `openai` client and raw HTTP, on the tiny model."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from server_helpers import RunningServer, metrics, slow_steps, sse_events, start_server

from conveyor.server.metrics import METRIC_NAMES

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def test_completion(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    result = client.completions.create(model=tiny_server.model_name, prompt="the quick brown fox", max_tokens=8,
                                       **GREEDY)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.model == tiny_server.model_name
    [choice] = result.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    num_prompt = len(tiny_server.engine.tokenizer.encode("the quick brown fox"))
    assert result.usage.prompt_tokens == num_prompt
    assert result.usage.completion_tokens == 8
    assert result.usage.total_tokens == num_prompt + 8


def test_completion_default_max_tokens_is_16(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    result = client.completions.create(model=tiny_server.model_name, prompt="hello", **GREEDY)
    assert result.usage.completion_tokens == 16


def test_completion_without_model_field(tiny_server: RunningServer) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["index"] == 0


def test_completion_streaming_equals_non_streaming(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    kwargs = dict(model=tiny_server.model_name, prompt="hello world", max_tokens=12, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    result = client.chat.completions.create(
        model=tiny_server.model_name, messages=[{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hello there"}],
        max_tokens=6, **GREEDY)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    [choice] = result.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    # The prompt went through the ChatML template: count its tokens as the server should.
    tokenizer = tiny_server.engine.tokenizer
    text = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello there"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert result.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_content_parts_equal_plain_content(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    plain = client.chat.completions.create(model=tiny_server.model_name, max_tokens=5, **GREEDY,
                                           messages=[{"role": "user", "content": "hello world"}])
    parts = client.chat.completions.create(model=tiny_server.model_name, max_tokens=5, **GREEDY,
                                           messages=[{"role": "user", "content": [{"type": "text",
                                                                                    "text": "hello world"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_default_max_tokens_runs_to_the_model_length(tiny_server: RunningServer) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["total_tokens"] == tiny_server.engine.max_model_len


def test_chat_streaming(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    kwargs = dict(model=tiny_server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                  **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_sse_format(tiny_server: RunningServer) -> None:
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    blocks = body.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(block.startswith("data: ") for block in blocks[:-1])
    events = sse_events(body.splitlines())
    assert "usage" not in events[1] or events[1]["usage"] is None
    assert events[1]["choices"][0]["delta"].keys() <= {"content"}  # only the first chunk names the role


@pytest.mark.parametrize("kind", ["strings", "token_lists"])
def test_multi_prompt_completion(client: openai.OpenAI, tiny_server: RunningServer, kind: str) -> None:
    texts = ["the quick brown fox", "hello", "What is the capital of France?", "def main():", "the sky is blue",
             "world"]
    tokenizer = tiny_server.engine.tokenizer
    prompts = texts if kind == "strings" else [tokenizer.encode(t) for t in texts]
    batch = client.completions.create(model=tiny_server.model_name, prompt=prompts, max_tokens=6, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(len(texts)))
    alone = [client.completions.create(model=tiny_server.model_name, prompt=p, max_tokens=6, **GREEDY)
             for p in prompts]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * len(texts)


def test_single_token_list_prompt_is_one_choice(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    ids = tiny_server.engine.tokenizer.encode("hello world")
    result = client.completions.create(model=tiny_server.model_name, prompt=ids, max_tokens=3, **GREEDY)
    assert len(result.choices) == 1 and result.usage.prompt_tokens == len(ids)


def test_multi_prompt_streaming_runs_in_one_batch(tiny_server: RunningServer) -> None:
    prompts = ["one two three", "hello", "the sky"]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", f"{tiny_server.base_url}/v1/completions", json={
                    "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as response:
                return [e async for e in _aevents(response)]

    # The order of the chunks cannot show the batching: steps of the tiny model can outrun the event
    # loop, which then drains one prompt's backlog before the next. The steps themselves can.
    with slow_steps(tiny_server.engine, 0.002) as steps:
        events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    indexes = [c["choices"][0]["index"] for c in chunks]
    assert set(indexes) == {0, 1, 2}
    assert any(len(ids) == 3 for ids in steps), "the prompts should run in one batch, not one after another"
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]
    whole = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=30, json={
        "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
    for index in range(3):
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
        assert streamed == whole["choices"][index]["text"]


async def _aevents(response: httpx.Response) -> AsyncIterator[dict | str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def test_completion_logprobs(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    result = client.completions.create(model=tiny_server.model_name, prompt="hello", max_tokens=4, logprobs=3,
                                       **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0 and token in top
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is the best
    assert logprobs.text_offset[0] == 0


def test_chat_logprobs(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    result = client.chat.completions.create(model=tiny_server.model_name, messages=[{"role": "user",
                                                                                     "content": "hi"}],
                                            max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_logprob_bytes_are_the_tokens_own_for_parts_of_a_character(client: openai.OpenAI,
                                                                    tiny_server: RunningServer) -> None:
    """Two single-byte tokens of "é" (0xC3 0xA9), pushed to the top with logit_bias: each entry's bytes are
    its own byte, not U+FFFD's, in the sampled entries and in top_logprobs; completions name them "bytes:"."""
    backend = tiny_server.engine.tokenizer.backend
    lead, tail = backend.token_to_id("\u00c3"), backend.token_to_id("\u00a9")   # byte-level spellings of 0xC3, 0xA9
    bias = {str(lead): 100, str(tail): 90}
    result = client.chat.completions.create(model=tiny_server.model_name, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1, logprobs=True, top_logprobs=2, logit_bias=bias, **GREEDY)
    entry = result.choices[0].logprobs.content[0]
    assert entry.bytes == [0xC3]
    assert [top.bytes for top in entry.top_logprobs] == [[0xC3], [0xA9]]
    completion = client.completions.create(model=tiny_server.model_name, prompt="hi", max_tokens=1, logprobs=2,
                                           logit_bias=bias, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == ["bytes:\\xc3"]
    assert set(logprobs.top_logprobs[0]) == {"bytes:\\xc3", "bytes:\\xa9"}


def test_stop_string(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    base = client.completions.create(model=tiny_server.model_name, prompt="the quick", max_tokens=20, **GREEDY)
    text = base.choices[0].text
    visible = [ch for ch in text.strip() if ch.isprintable() and not ch.isspace()]
    if len(visible) < 2:
        pytest.skip("the random model produced too little visible text to cut at a stop string")
    stop = visible[len(visible) // 2]
    cut = client.completions.create(model=tiny_server.model_name, prompt="the quick", max_tokens=20, stop=stop,
                                    **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_models_health_metrics(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_server.model_name]
    assert models.data[0].model_extra["max_model_len"] == tiny_server.engine.max_model_len
    assert httpx.get(f"{tiny_server.base_url}/health").json() == {"status": "ok"}
    client.completions.create(model=tiny_server.model_name, prompt="hi", max_tokens=3, **GREEDY)
    text = httpx.get(f"{tiny_server.base_url}/metrics").text
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    values = metrics(tiny_server.base_url)
    assert values["vllm:generation_tokens_total"] >= 3
    assert values["vllm:e2e_request_latency_seconds_count"] >= 1
    assert values["vllm:inter_token_latency_seconds_count"] >= 2
    assert values["conveyor:decode_throughput_tokens_per_second"] > 0
    assert values["conveyor:avg_sequences_per_step"] >= 1
    assert values["vllm:kv_cache_usage_perc"] == 0.0 and values["vllm:num_requests_running"] == 0
    info = tiny_server.engine.core.info
    assert values["conveyor:kv_cache_capacity_tokens"] == info.num_kv_blocks * info.block_size
    assert values["conveyor:kv_cache_memory_bytes"] > 0 and f'cache_dtype="{info.kv_cache_dtype}"' in text
    # The per-request histograms vLLM's dashboard reads, for the one request of 3 tokens.
    assert values["vllm:time_per_output_token_seconds_count"] == values["vllm:inter_token_latency_seconds_count"]
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_max_num_generation_tokens"):
        assert values[f"vllm:{name}_count"] >= 1, name
    assert values["vllm:request_generation_tokens_sum"] >= 3 and values["vllm:request_params_max_tokens_sum"] >= 3
    assert values["vllm:iteration_tokens_total_sum"] >= values["vllm:generation_tokens_total"]


def test_openapi_document(tiny_server: RunningServer) -> None:
    doc = httpx.get(f"{tiny_server.base_url}/openapi.json").json()
    paths = doc["paths"]
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/health", "get"), ("/metrics", "get")]:
        assert method in paths[path], path
    completions = paths["/v1/completions"]["post"]
    body_ref = completions["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/CompletionRequest")
    ok = completions["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    assert "text/event-stream" in ok
    for status in ("400", "401", "404", "413", "429", "500"):
        assert completions["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
    chat_body = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in ("messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                  "stop", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "ignore_eos",
                  "min_tokens", "priority", "stream", "stream_options"):
        assert field in chat_body, field
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]


def test_periodic_stats_line(tiny_checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    server = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"stats_log_interval_s": 0.05})
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        # Steps slowed to 5 ms: the line needs 50 ms of busy time, which 100 tiny-model tokens can undercut.
        with caplog.at_level(logging.INFO, logger="conveyor.server.metrics"), slow_steps(server.engine, 0.005):
            client.completions.create(model=server.model_name, prompt="hello", max_tokens=100, **GREEDY)
        lines = [r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage()]
        assert lines and "Running:" in lines[0] and "KV cache usage:" in lines[0]
    finally:
        server.stop()


def test_first_stats_line_after_an_idle_start_averages_only_busy_time(tiny_checkpoint,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Idle time before a request is no part of the average: a server idle for 2 s, then generating at
    ~50 tokens/s (steps slowed to 20 ms), must not report ~0 tokens/s in its first line."""
    import time

    server = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"stats_log_interval_s": 0.5})
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        time.sleep(2.0)
        with caplog.at_level(logging.INFO, logger="conveyor.server.metrics"), slow_steps(server.engine, 0.02):
            client.completions.create(model=server.model_name, prompt="hello", max_tokens=100, **GREEDY)
        lines = [r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage()]
        assert lines
        rate = float(lines[0].split("Avg generation throughput: ")[1].split(" ")[0])
        assert rate > 2.0, lines[0]   # averaged over the idle 2 s as well, it would be under 1
    finally:
        server.stop()
