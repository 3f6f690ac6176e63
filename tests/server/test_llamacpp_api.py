"""llama-server's native API (/completion, /props, /slots, /health) on the tiny model, with the expectations
of llama.cpp's own server tests (tools/server/tests/unit/test_completion.py, test_basic.py) that apply."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import RunningServer

PROMPT = "I believe the meaning of life is"


def _post(server: RunningServer, body: dict, path: str = "/completion") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def _stream(server: RunningServer, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.base_url}/completion", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.mark.parametrize("n_predict,return_tokens", [(8, False), (24, True)])
def test_completion(tiny_server: RunningServer, n_predict: int, return_tokens: bool) -> None:
    num_prompt = len(tiny_server.engine.tokenizer.encode(PROMPT))
    res = _post(tiny_server, {"n_predict": n_predict, "prompt": PROMPT, "return_tokens": return_tokens,
                              "ignore_eos": True, "cache_prompt": False})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["timings"]["prompt_n"] == body["tokens_evaluated"] == num_prompt
    assert body["timings"]["predicted_n"] == body["tokens_predicted"] == n_predict
    assert body["truncated"] is False and isinstance(body["has_new_line"], bool) and isinstance(body["content"], str)
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopped_limit"] is True
    assert body["stopped_eos"] is body["stopped_word"] is False
    assert body["generation_settings"]["n_predict"] == n_predict
    if return_tokens:
        assert len(body["tokens"]) == n_predict and all(isinstance(t, int) for t in body["tokens"])
    else:
        assert body["tokens"] == []


def test_completion_stream_vs_non_stream(tiny_server: RunningServer) -> None:
    request = {"n_predict": 10, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    whole = _post(tiny_server, request).json()
    events = _stream(tiny_server, request)
    content = ""
    for data in events:
        assert isinstance(data["stop"], bool)
        if data["stop"]:
            assert data["timings"]["predicted_n"] == 10 and data["stop_type"] == "limit"
            assert data["generation_settings"]["n_predict"] == 10 and "truncated" in data
        else:
            assert data["tokens"] and all(isinstance(t, int) for t in data["tokens"])
            content += data["content"]
    assert events[-1]["stop"] and content == whole["content"]


def test_seeds(tiny_server: RunningServer) -> None:
    def content(seed: int, temperature: float) -> str:
        return _post(tiny_server, {"prompt": PROMPT, "seed": seed, "temperature": temperature, "n_predict": 16,
                                   "ignore_eos": True}).json()["content"]

    assert len({content(42, 0.0) for _ in range(3)}) == 1
    assert len({content(42, 1.0) for _ in range(2)}) == 1
    assert len({content(seed, 1.0) for seed in range(4)}) > 1


def test_completion_with_tokens_input(tiny_server: RunningServer) -> None:
    tokens = tiny_server.engine.tokenizer.encode(PROMPT)
    base = {"temperature": 0, "n_predict": 6}
    single = _post(tiny_server, {**base, "prompt": tokens}).json()
    assert isinstance(single["content"], str)
    for batch in ([tokens, tokens], [tokens, PROMPT], [tokens, {"prompt_string": PROMPT}]):
        body = _post(tiny_server, {**base, "prompt": batch}).json()
        assert isinstance(body, list) and len(body) == 2
        assert body[0]["content"] == body[1]["content"] == single["content"]
        assert [b["index"] for b in body] == [0, 1]
    mixed = _post(tiny_server, {**base, "prompt": [1, 2, 3, 4, 5, 6, PROMPT, 7, 8, 9, 10, PROMPT]}).json()
    assert isinstance(mixed["content"], str)


def test_response_fields(tiny_server: RunningServer) -> None:
    body = _post(tiny_server, {"n_predict": 8, "prompt": PROMPT,
                               "response_fields": ["content", "generation_settings/n_predict", "prompt"]}).json()
    assert body["generation_settings/n_predict"] == 8 and isinstance(body["content"], str)
    assert body["prompt"] == tiny_server.engine.tokenizer.decode(tiny_server.engine.tokenizer.encode(PROMPT), False)
    assert len(body) == 3


def test_n_probs(tiny_server: RunningServer) -> None:
    body = _post(tiny_server, {"prompt": PROMPT, "n_probs": 10, "temperature": 0, "n_predict": 5,
                               "ignore_eos": True}).json()
    assert len(body["completion_probabilities"]) == 5
    for tok in body["completion_probabilities"]:
        assert isinstance(tok["id"], int) and isinstance(tok["token"], str) and tok["logprob"] <= 0
        assert isinstance(tok["bytes"], list) and len(tok["top_logprobs"]) == 10
        assert tok["logprob"] == pytest.approx(tok["top_logprobs"][0]["logprob"])   # greedy: the best
        for prob in tok["top_logprobs"]:
            assert {"id", "token", "logprob", "bytes"} <= set(prob) and prob["logprob"] <= 0
    for data in _stream(tiny_server, {"prompt": PROMPT, "n_probs": 3, "temperature": 0, "n_predict": 5,
                                      "ignore_eos": True}):
        if not data["stop"]:   # a client slower than the steps gets several tokens in one event
            assert len(data["completion_probabilities"]) == len(data["tokens"]) >= 1
            assert all(len(prob["top_logprobs"]) == 3 for prob in data["completion_probabilities"])


@pytest.mark.parametrize("openai_style", [False, True])
def test_logit_bias_bans(tiny_server: RunningServer, openai_style: bool) -> None:
    free = _post(tiny_server, {"prompt": PROMPT, "temperature": 0, "n_predict": 12, "ignore_eos": True,
                               "return_tokens": True}).json()["tokens"]
    banned = sorted(set(free))[:3]
    bias = {str(t): False for t in banned} if openai_style else [[t, -100] for t in banned]
    held = _post(tiny_server, {"prompt": PROMPT, "temperature": 0, "n_predict": 12, "ignore_eos": True,
                               "return_tokens": True, "logit_bias": bias}).json()["tokens"]
    assert len(held) == 12 and not set(held) & set(banned)


def test_stop_word_and_eos(tiny_server: RunningServer) -> None:
    free = _post(tiny_server, {"prompt": PROMPT, "temperature": 0, "n_predict": 12, "ignore_eos": True}).json()
    word = free["content"][3:6]
    stopped = _post(tiny_server, {"prompt": PROMPT, "temperature": 0, "n_predict": 12, "ignore_eos": True,
                                  "stop": [word]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopped_word"] and stopped["stopping_word"] == word
    assert stopped["content"] == free["content"][:free["content"].index(word)]
    eos = tiny_server.engine.tokenizer.eos_token_ids
    ended = _post(tiny_server, {"prompt": PROMPT, "temperature": 0, "n_predict": 50,
                                "logit_bias": [[t, 100] for t in eos]}).json()
    assert ended["stop_type"] == "eos" and ended["stopped_eos"] and ended["tokens_predicted"] == 1


def test_cache_prompt(tiny_server: RunningServer) -> None:
    prompt = " ".join([PROMPT] * 6)   # several KV blocks
    request = {"prompt": prompt, "n_predict": 2, "temperature": 0}
    _post(tiny_server, request)
    assert _post(tiny_server, request).json()["timings"]["cache_n"] > 0
    uncached = _post(tiny_server, {**request, "cache_prompt": False}).json()["timings"]
    assert uncached["cache_n"] == 0 and uncached["prompt_n"] == len(tiny_server.engine.tokenizer.encode(prompt))


def test_props_slots_health(tiny_server: RunningServer) -> None:
    props = httpx.get(f"{tiny_server.base_url}/props", timeout=10).json()
    max_num_seqs = tiny_server.engine.core.info.scheduler.max_num_seqs
    assert props["total_slots"] == max_num_seqs and props["model_alias"] == tiny_server.model_name
    assert props["default_generation_settings"]["n_ctx"] == tiny_server.engine.core.info.max_model_len
    assert props["default_generation_settings"]["params"]["seed"] == -1 and props["model_path"]
    assert props["chat_template_caps"]["supports_system_role"] is True and props["model_ftype"]
    slots = httpx.get(f"{tiny_server.base_url}/slots", timeout=10).json()
    assert len(slots) == max_num_seqs and "params" not in slots[0]
    assert slots[0]["n_ctx"] == props["default_generation_settings"]["n_ctx"]
    assert httpx.get(f"{tiny_server.base_url}/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.parametrize("fields,param", [
    ({"mirostat": 2}, "mirostat"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"n_predict": -5}, "n_predict"),
    ({"n_probs": 50}, "n_probs"),
    ({"n_predict": 10**7}, "n_predict"),
    ({"repeat_penalty": 1.3, "repeat_last_n": 64}, "repeat_last_n"),
    ({"prompt": [[1, 2]] * 3000}, "prompt"),
    ({"prompt": [[1, True]]}, "prompt"),
    ({"prompt": {"prompt_string": "hi", "multimodal_data": ["x"]}}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [PROMPT] * 40, "n_probs": 20, "n_predict": 200}, "n_probs"),   # 40 x 200 x 21 logprob entries
])
def test_refusals(tiny_server: RunningServer, fields: dict, param: str) -> None:
    res = _post(tiny_server, {"prompt": PROMPT, **fields})
    assert res.status_code == 400, res.text[:300]
    assert res.json()["error"]["param"] == param


def test_inert_defaults_a_front_end_sends_are_accepted(tiny_server: RunningServer) -> None:
    res = _post(tiny_server, {"prompt": PROMPT, "n_predict": 2, "mirostat": 0, "typical_p": 1, "dry_multiplier": 0,
                              "xtc_probability": 0, "samplers": ["top_k", "top_p", "min_p", "temperature"],
                              "repeat_last_n": 64, "n_keep": 0, "timings_per_token": False})
    assert res.status_code == 200, res.text


def test_grammar_and_n_predict_0(tiny_server: RunningServer) -> None:
    body = _post(tiny_server, {"prompt": PROMPT, "grammar": 'root ::= "yes" | "no"', "temperature": 1.0,
                               "seed": 5}).json()
    assert body["content"] in ("yes", "no") and body["stop_type"] == "eos"
    empty = _post(tiny_server, {"prompt": PROMPT, "n_predict": 0, "return_tokens": True}).json()
    assert empty["content"] == "" and empty["tokens"] == [] and empty["tokens_predicted"] == 0
    assert empty["timings"]["predicted_n"] == 0 and empty["tokens_evaluated"] > 0
