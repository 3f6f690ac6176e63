"""Outputs a consumer has not taken yet merge into one: a slow HTTP response catches up instead of
falling further behind, with the same tokens, text and logprobs in the same order."""

from __future__ import annotations

import asyncio

import pytest
from helpers import RecordingClient, tiny_bpe_tokenizer

from conveyor.engine.messages import (
    AbortRequests,
    CoreInfo,
    CoreLoad,
    RequestOutput,
    StepOutputs,
    TokenDelta,
)
from conveyor.errors import ConveyorError
from conveyor.front.async_engine import AsyncEngine
from conveyor.front.output_stream import OutputStream
from conveyor.logprobs import TokenLogprobs
from conveyor.sampling_params import SamplingParams
from conveyor.server.openai_api.prompt_group import PromptGroup
from conveyor.text.tokenizer import Tokenizer

INFO = CoreInfo(vocab_size=300, max_model_len=64, num_kv_blocks=8, block_size=16, startup_s=0.0)
LOAD = CoreLoad(0, 0, 0, 0.0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_bpe_tokenizer()




def _output(tokens: list[int], text: str, finish: str | None = None) -> RequestOutput:
    output = RequestOutput("r", tokens, text, [TokenLogprobs(t, -0.5, [(t, -0.5)]) for t in tokens])
    if finish is not None:
        output.finished, output.finish_reason, output.prompt_token_ids = True, finish, [1]
    return output


def test_outputs_waiting_merge_in_order_and_wake_once() -> None:
    woken: list[int] = []
    stream = OutputStream(lambda: woken.append(1))
    stream.put(_output([5], "a"))
    stream.put(_output([6, 7], "bc"))
    stream.put(_output([8], "d", finish="length"))
    stream.put(ConveyorError("after the end"))     # never merged into a finished output
    assert woken == [1] and stream.has_ended
    merged, error = stream.take()
    assert merged.new_token_ids == [5, 6, 7, 8] and merged.new_text == "abcd"
    assert [lp.token_id for lp in merged.new_logprobs] == [5, 6, 7, 8]
    assert merged.finished and merged.finish_reason == "length" and merged.prompt_token_ids == [1]
    assert isinstance(error, ConveyorError)
    assert stream.take() == []
    stream.put(_output([9], "e"))
    assert woken == [1, 1]


def test_get_waits_for_output_then_returns_all_of_it() -> None:
    async def run() -> RequestOutput:
        stream = OutputStream()
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put(_output([1], "x"))
        stream.put(_output([2], "y"))   # before the waiter ran: merged
        return await waiting

    output = asyncio.run(run())
    assert output.new_token_ids == [1, 2] and output.new_text == "xy"


def _step(engine: AsyncEngine, deltas: list[TokenDelta]) -> None:
    engine._on_outputs(StepOutputs(deltas, LOAD))


def test_a_consumer_behind_the_steps_gets_them_merged_with_the_same_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the quick brown fox jumps")

    async def run() -> tuple[list[tuple[int, RequestOutput]], AsyncEngine]:
        engine = AsyncEngine(RecordingClient(INFO), tokenizer)  # type: ignore[arg-type]
        group = PromptGroup(engine, "g", [[1, 2], [3]], SamplingParams(max_tokens=len(ids)))
        for i, token_id in enumerate(ids):   # every step before the consumer looks
            last = i == len(ids) - 1
            _step(engine, [TokenDelta("g-1", [token_id], finish_reason="length" if last else None),
                           TokenDelta("g-0", [token_id], finish_reason="length" if last else None)])
        received = [item async for item in group.outputs()]
        group.close()
        return received, engine

    received, engine = asyncio.run(run())
    assert [index for index, _ in received] == [1, 0]          # in the order their output came
    for _, output in received:
        assert output.new_token_ids == ids and output.new_text == "the quick brown fox jumps" and output.finished
    assert engine.num_in_flight == 0 and engine.tenant_in_flight == {}


def test_closing_aborts_only_what_has_not_ended(tokenizer: Tokenizer) -> None:
    async def run() -> tuple[RecordingClient, AsyncEngine, bool]:
        client = RecordingClient(INFO)
        engine = AsyncEngine(client, tokenizer)  # type: ignore[arg-type]
        group = PromptGroup(engine, "g", [[1], [2]], SamplingParams(max_tokens=4))
        _step(engine, [TokenDelta("g-0", [5], finish_reason="length")])   # ended, never taken
        _step(engine, [TokenDelta("g-1", [5])])
        group.close()
        return client, engine, await group.wait_first_choices()

    client, engine, all_ended = asyncio.run(run())
    aborts = [c.request_ids for c in client.sent if isinstance(c, AbortRequests)]
    assert aborts == [["g-1"]] and engine.num_in_flight == 0 and not all_ended


def test_merged_outputs_keep_each_steps_text_and_tokens_for_reasoning_counts() -> None:
    from conveyor.server.openai_api.chat_output import ChatOutputSplitter
    from conveyor.server.parsing.reasoning import ReasoningStream

    stream = OutputStream()
    for text, tokens in (("ab", [1]), ("c</think>", [2, 3]), ("xy", [4]), ("z", [5])):
        stream.put(RequestOutput("r", tokens, text))
    merged = stream.take()[0]
    assert merged.new_text == "abc</think>xyz" and merged.steps == [(2, 1), (9, 2), (2, 1), (1, 1)]
    splitter = ChatOutputSplitter(ReasoningStream(in_reasoning=True), None, forces_tool_calls=False)
    thinking, content = splitter.split_thinking(merged.new_text, len(merged.new_token_ids), False, merged.steps)
    # as one step at a time would count: the step that closes the thinking is thinking, the rest answer
    assert (thinking, splitter.num_reasoning_tokens) == ("abc", 3) and content.startswith("xy")
