"""A front that falls behind the core catches up: the steps it missed reach the client as one chunk, with the
same tokens and text as a front that kept up (without logprobs, through the chunk template)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from server_helpers import RunningServer

from conveyor.engine.messages import StepOutputs

PROMPT = "the quick brown fox"
MAX_TOKENS = 40


@pytest.fixture
def stalled_once(tiny_server: RunningServer) -> Iterator[list[int]]:
    """Blocks the server's event loop for 0.3 s at the first message with output: the core, on its own
    thread, goes on stepping meanwhile."""
    stalls: list[int] = []
    observers = tiny_server.server.async_engine.observers

    def stall(outputs: StepOutputs) -> None:
        if not stalls and any(delta.new_token_ids for delta in outputs.deltas):
            stalls.append(len(outputs.deltas))
            time.sleep(0.3)

    observers.append(stall)
    yield stalls
    observers.remove(stall)


@pytest.mark.parametrize("logprobs", [None, 0])
def test_missed_steps_arrive_merged_with_the_same_text(tiny_server: RunningServer, stalled_once: list[int],
                                                       logprobs: int | None) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    request = dict(model=tiny_server.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                   logprobs=logprobs, extra_body={"ignore_eos": True})
    whole = client.completions.create(**request)
    stalled_once.clear()
    chunks = [chunk for chunk in client.completions.create(**request, stream=True,
                                                           stream_options={"include_usage": True})]
    assert stalled_once, "the loop was never stalled"
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    if logprobs is not None:   # every chunk lists its tokens: the steps run while the loop was blocked came as one
        per_chunk = [c.choices[0].logprobs.tokens for c in chunks if c.choices]
        assert [t for tokens in per_chunk for t in tokens] == whole.choices[0].logprobs.tokens
        assert max(map(len, per_chunk)) > 1 and len(per_chunk) < MAX_TOKENS
