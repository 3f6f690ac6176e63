"""One validation path: a bad request gets the same error offline (`LLM`) as from the server (its 400 body)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import SMALL_ENGINE, RunningServer

from conveyor.errors import ContextLengthExceeded, ConveyorError
from conveyor.llm import LLM
from conveyor.sampling_params import SamplingParams

HI = "hello world"
# (prompt, the request's sampling fields as JSON sends them); offline gets the same values, with
# logit_bias keyed by int rather than by the token id's text.
CASES: list[tuple[str | list[int], dict[str, Any]]] = [
    (HI, {"temperature": -0.5}),
    (HI, {"temperature": 100.5}),
    (HI, {"top_p": 0.0}),
    (HI, {"top_p": 1.5}),
    (HI, {"top_k": -2}),
    (HI, {"top_k": 2**40}),
    (HI, {"min_p": 1.5}),
    (HI, {"n": 0}),
    (HI, {"n": 129}),
    (HI, {"n": 2, "best_of": 3}),
    (HI, {"max_tokens": 0}),
    (HI, {"max_tokens": 100_000}),                     # beyond the context
    (HI, {"min_tokens": -1}),
    (HI, {"min_tokens": 9, "max_tokens": 4}),
    (HI, {"stop_token_ids": [-1]}),
    (HI, {"stop_token_ids": [3, 10**12]}),             # outside the vocabulary
    (HI, {"logit_bias": {"5": 100.5}}),
    (HI, {"logit_bias": {"5": 1.0, "1000000": 2.0}}),  # outside the vocabulary
    (HI, {"logprobs": 21}),
    (HI, {"presence_penalty": 2.5}),
    (HI, {"frequency_penalty": -2.5}),
    (HI, {"repetition_penalty": 0.0}),
    (HI, {"repetition_penalty": 100.5}),
    (HI, {"seed": 2**64}),
    (HI, {"seed": -(2**63) - 1}),
    (HI, {"stop": [""]}),
    ([], {}),                                          # an empty prompt
    ([5] * 300, {"max_tokens": 5}),                    # a prompt past the context
    ([5, 10**9], {}),                                  # a prompt token outside the vocabulary
]


@pytest.fixture(scope="module")
def offline(tiny_server: RunningServer, tiny_checkpoint: Path) -> Iterator[LLM]:
    """An offline LLM with the limits of the shared server (same model length and KV cache)."""
    llm = LLM(str(tiny_checkpoint), **SMALL_ENGINE, max_num_seqs=4)
    assert llm.engine.core.info.max_model_len == tiny_server.engine.core.info.max_model_len
    assert llm.engine.core.info.num_kv_blocks == tiny_server.engine.core.info.num_kv_blocks
    yield llm


def _offline_error(llm: LLM, prompt: str | list[int], fields: dict[str, Any]) -> ConveyorError:
    options = dict(fields)
    if "logit_bias" in options:
        options["logit_bias"] = {int(token): bias for token, bias in options["logit_bias"].items()}
    with pytest.raises(ConveyorError) as info:
        llm.generate([prompt], SamplingParams(**{"max_tokens": 16, **options}), use_tqdm=False)
    return info.value


@pytest.mark.parametrize("prompt,fields", CASES, ids=[f"{i}-{','.join(f) or 'prompt'}" for i, (_, f) in
                                                       enumerate(CASES)])
def test_offline_and_server_refuse_alike(tiny_server: RunningServer, offline: LLM, prompt: str | list[int],
                                         fields: dict[str, Any]) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=30,
                          json={"prompt": [prompt] if isinstance(prompt, list) else prompt, **fields})
    assert response.status_code == 400, response.text
    online = response.json()["error"]
    error = _offline_error(offline, prompt, fields)
    assert (error.status, error.error_type, error.code) == (400, online["type"], online["code"])
    assert isinstance(error, ContextLengthExceeded) == (online["code"] == "context_length_exceeded")
    assert (error.message, error.param) == (online["message"], online["param"])


@pytest.mark.parametrize("fields", [{"temperature": -0.5}, {"stop_token_ids": [10**12]}, {"max_tokens": 100_000}])
def test_offline_chat_and_server_chat_refuse_alike(tiny_server: RunningServer, offline: LLM,
                                                   fields: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "hi"}]
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=30,
                          json={"messages": messages, **fields})
    assert response.status_code == 400, response.text
    online = response.json()["error"]
    with pytest.raises(ConveyorError) as info:
        offline.chat(messages, SamplingParams(**fields), use_tqdm=False)
    assert (info.value.message, info.value.param, info.value.code) == (online["message"], online["param"],
                                                                      online["code"])
