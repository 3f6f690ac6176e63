"""Scoring a prompt over HTTP: completions' echo with logprobs (lm-evaluation-harness's loglikelihood request)
and vLLM's prompt_logprobs, through the official `openai` client and raw HTTP, against transformers."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_helpers import RunningServer, sse_events



@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tol(tiny_server: RunningServer) -> float:
    """float32 engines match transformers closely; a bfloat16 one (--dtype auto on a BF16 CPU) to its precision."""
    return 1e-4 if tiny_server.engine.core.dtype == torch.float32 else 5e-2


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32,
                                                 attn_implementation="eager").eval()

    def scores(prompt: list[int]) -> list[float]:
        """Each prompt token's logprob after the ones before it (from the second on)."""
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)
        return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()

    return scores


def test_lm_eval_loglikelihood_request(client: openai.OpenAI, tiny_server: RunningServer, reference, tol: float) -> None:
    """The request lm-evaluation-harness's local-completions sends, parsed as it parses it."""
    tokenizer = tiny_server.engine.tokenizer
    contexts = [tokenizer.encode("the quick brown"), tokenizer.encode("hello")]
    continuations = [tokenizer.encode(" fox jumps"), tokenizer.encode(" world")]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    result = client.completions.create(model=tiny_server.model_name, prompt=prompts, temperature=0, max_tokens=1,
                                       logprobs=1, seed=1234, echo=True)
    for choice, prompt, context in zip(sorted(result.choices, key=lambda c: c.index), prompts, contexts):
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(prompt) + 1
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.tokens[:len(prompt)] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
        scored = logprobs.token_logprobs[1:len(prompt)]
        assert scored == pytest.approx(reference(prompt), abs=tol)
        continuation = logprobs.token_logprobs[len(context):-1]   # lm-eval's slice
        is_greedy = all(lp == max(top.values()) for lp, top in
                        zip(continuation, logprobs.top_logprobs[len(context):-1]))
        assert sum(continuation) < 0 and isinstance(is_greedy, bool)
        for lp, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
            assert lp in top.values() and 1 <= len(top) <= 2   # the top 1, and the prompt's own token
        assert choice.text.startswith(tokenizer.decode(prompt, skip_special_tokens=False))
    assert result.usage.completion_tokens == 2


def test_echo_with_max_tokens_0_is_the_prompt_alone(client: openai.OpenAI, tiny_server: RunningServer,
                                                     reference, tol: float) -> None:
    prompt = "the quick brown fox"
    ids = tiny_server.engine.tokenizer.encode(prompt)
    result = client.completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=0)
    [choice] = result.choices
    assert choice.text == prompt and result.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(reference(ids), abs=tol)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_echo_streamed_equals_whole(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    kwargs = dict(model=tiny_server.model_name, prompt="hello world", max_tokens=5, echo=True, logprobs=2,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == whole.text and whole.text.startswith("hello world")
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    plain = client.completions.create(model=tiny_server.model_name, prompt="hello world", max_tokens=3, echo=True,
                                      temperature=0).choices[0]
    assert plain.text.startswith("hello world") and plain.logprobs is None


def test_prompt_logprobs_completions_and_chat(client: openai.OpenAI, tiny_server: RunningServer, reference, tol: float) -> None:
    ids = tiny_server.engine.tokenizer.encode("one two three four")
    body = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=30, json={
        "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for token_id, expected, entry in zip(ids[1:], reference(ids), scored[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(expected, abs=tol) and own["rank"] >= 1
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2] and 2 <= len(entry) <= 3
        assert ranked[0]["logprob"] >= own["logprob"]
    chat = client.chat.completions.create(model=tiny_server.model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    chat_scores = chat.model_extra["prompt_logprobs"]
    assert chat_scores[0] is None and all(len(e) == 1 for e in chat_scores[1:])
    assert len(chat_scores) == chat.usage.prompt_tokens
    assert client.completions.create(model=tiny_server.model_name, prompt="hi", max_tokens=1).choices[0] \
        .model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "echo": True, "logprobs": 20, "max_tokens": 1, "prompt": [1] * 4000}, "logprobs"),
])
def test_scoring_refusals(tiny_server: RunningServer, body: dict, param: str) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_echo_stream_events_shape(tiny_server: RunningServer) -> None:
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", timeout=30, json={
            "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}) as response:
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    [chunk] = events[:-1]
    assert chunk["choices"][0]["text"] == "abc" and chunk["choices"][0]["finish_reason"] == "length"
