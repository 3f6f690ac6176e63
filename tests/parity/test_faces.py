"""The offline face (LLMEngine over an InlineCoreClient) and the server's (AsyncEngine over a ThreadCoreClient)
run one scenario and give the same results: requests tracked to their end, a stop string found by the front
and ended in the core, an abort mid-generation, a duplicate request id refused while the first runs. Each
face is also held to the scenario's expected outcome, so either one drifting fails."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.core import EngineCore
from conveyor.engine.core_client import ThreadCoreClient
from conveyor.engine.messages import AbortRequests, AddRequests, CoreCommand, FinishRequests, RequestOutput
from conveyor.errors import InvalidRequest
from conveyor.front.async_engine import AsyncEngine
from conveyor.front.llm_engine import LLMEngine
from conveyor.sampling_params import SamplingParams

PROMPTS = {"plain0": [5, 6, 7, 8], "plain1": [9, 10, 11], "plain2": [12, 13, 14, 15, 16], "stop": [17, 18, 19],
           "aborted": [20, 21, 22, 23]}
NUM_TOKENS = 16
ABORTED_MAX_TOKENS = 200   # far more than it gets before its caller aborts it, however the outputs are merged
ABORT_AFTER = 3            # tokens the aborted request's caller takes before it aborts


def greedy(max_tokens: int = NUM_TOKENS, stop: list[str] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop or [])


def params_of(request_id: str, stop: str | None = None) -> SamplingParams:
    if request_id == "aborted":
        return greedy(ABORTED_MAX_TOKENS)
    return greedy(stop=[stop] if request_id == "stop" and stop is not None else None)


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None     # None: never finished for its caller (aborted)
    stop_reason: int | str | None = None
    num_output_tokens: int | None = None   # the core's figure, where the output carries it

    def take(self, output: RequestOutput) -> None:
        self.token_ids += output.new_token_ids
        self.text += output.new_text
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
            self.num_output_tokens = None if output.metrics is None else output.metrics.num_output_tokens


@pytest.fixture(scope="module")
def config(tiny_checkpoint: Path) -> EngineConfig:
    return EngineConfig.from_options(model=str(tiny_checkpoint), threads=2, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def offline(config: EngineConfig) -> LLMEngine:
    return LLMEngine(config)


@pytest.fixture(scope="module")
def reference(offline: LLMEngine) -> dict[str, Result]:
    """Each prompt alone, no stop string: what the scenario's requests are cut from."""
    results = {}
    for request_id, prompt in PROMPTS.items():
        results[request_id] = Result([], "")
        offline.add_request(prompt, params_of(request_id), request_id=request_id)
        while offline.has_unfinished_requests():
            for output in offline.step():
                results[request_id].take(output)
    return results


@pytest.fixture(scope="module")
def stop_string(reference: dict[str, Result]) -> tuple[str, int]:
    """A 3-character string of the "stop" request's text whose first place is past its start: (it, its index)."""
    text = reference["stop"].text
    index = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    return text[index:index + 3], index


def run_offline(engine: LLMEngine, stop: str) -> dict[str, Result]:
    results = {request_id: Result([], "") for request_id in PROMPTS}
    for request_id, prompt in PROMPTS.items():
        engine.add_request(prompt, params_of(request_id, stop), request_id=request_id)
    with pytest.raises(InvalidRequest, match="duplicate request id 'plain0'"):
        engine.add_request([30, 31], greedy(), request_id="plain0")
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert results[output.request_id].finish_reason is None, "an output after the request finished"
            results[output.request_id].take(output)
        if "aborted" in engine.front.processor and len(results["aborted"].token_ids) >= ABORT_AFTER:
            assert engine.abort_request("aborted")
    return results


async def run_async(engine: AsyncEngine, stop: str) -> dict[str, Result]:
    results = {request_id: Result([], "") for request_id in PROMPTS}
    streams = {request_id: engine.add([prompt], params_of(request_id, stop), [request_id])[0]
               for request_id, prompt in PROMPTS.items()}
    with pytest.raises(InvalidRequest, match="duplicate request id 'plain0'"):
        engine.add([[30, 31]], greedy(), ["plain0"])

    async def consume(request_id: str) -> None:
        async with contextlib.aclosing(engine.outputs(request_id, streams[request_id])) as outputs:
            async for output in outputs:
                results[request_id].take(output)
                if request_id == "aborted" and len(results[request_id].token_ids) >= ABORT_AFTER:
                    return   # leaving the stream aborts the request, as a client that goes away does

    await asyncio.wait_for(asyncio.gather(*(consume(request_id) for request_id in PROMPTS)), 60)
    return results


def record_commands(core: EngineCore) -> list[tuple]:
    """What the core is told, as (kind, request ids or stops): the same from both faces."""
    received: list[tuple] = []
    handle = core.handle

    def recording(command: CoreCommand) -> None:
        if isinstance(command, AddRequests):
            received.append(("add", *(request.request_id for request in command.requests)))
        elif isinstance(command, AbortRequests):
            received.append(("abort", *command.request_ids))
        elif isinstance(command, FinishRequests):
            received.append(("finish", *command.stops))
        handle(command)

    core.handle = recording  # type: ignore[method-assign]
    return received


def server_face(config: EngineConfig, stop: str) -> tuple[dict[str, Result], EngineCore, AsyncEngine, list[tuple]]:
    offline = LLMEngine(config)   # for its core and tokenizer, as the server's test helpers build one
    engine = AsyncEngine(ThreadCoreClient(offline.core), offline.tokenizer)
    received = record_commands(offline.core)

    async def main() -> dict[str, Result]:
        engine.start()
        try:
            results = await run_async(engine, stop)
            # The abort and the stop string's finish reach the core thread after the last output.
            for _ in range(500):
                if not offline.core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return results
        finally:
            await engine.shutdown(0.0)

    return asyncio.run(main()), offline.core, engine, received


def check_scenario(results: dict[str, Result], reference: dict[str, Result], stop: tuple[str, int]) -> None:
    """What each face must give, whatever the other does."""
    for request_id in ("plain0", "plain1", "plain2"):
        assert results[request_id] == reference[request_id], request_id
    stopped, full = results["stop"], reference["stop"]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (full.text[:stop[1]], "stop", stop[0])
    assert 0 < len(stopped.token_ids) < NUM_TOKENS and stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    aborted = results["aborted"]
    assert aborted.finish_reason is None and ABORT_AFTER <= len(aborted.token_ids) < ABORTED_MAX_TOKENS
    assert aborted.token_ids == reference["aborted"].token_ids[:len(aborted.token_ids)]


def check_core(core: EngineCore, received: list[tuple], stop: str) -> None:
    """The core was told to end the stop string's request and the aborted one (and nothing of the refused
    duplicate), and holds nothing after."""
    assert sorted(received) == sorted([("abort", "aborted"), *(("add", request_id) for request_id in PROMPTS),
                                       ("finish", ("stop", stop))])
    assert not core.has_unfinished_requests() and not core.scheduler.requests
    assert core.blocks.num_used_blocks == 0


def test_both_faces_track_stop_and_abort_alike(config: EngineConfig, offline: LLMEngine,
                                               reference: dict[str, Result], stop_string: tuple[str, int]) -> None:
    received = record_commands(offline.core)
    offline_results = run_offline(offline, stop_string[0])
    check_scenario(offline_results, reference, stop_string)
    check_core(offline.core, received, stop_string[0])
    assert len(offline.front.processor) == 0
    # Offline, the core answers a stop string's finish at once: the output carries its final figures.
    assert offline_results["stop"].num_output_tokens == len(offline_results["stop"].token_ids)

    server_results, core, async_engine, received = server_face(config, stop_string[0])
    check_scenario(server_results, reference, stop_string)
    check_core(core, received, stop_string[0])
    assert len(async_engine.processor) == 0 and async_engine.num_in_flight == 0 and async_engine.num_owed == 0

    for request_id in ("plain0", "plain1", "plain2"):   # text, tokens, finish and the core's figures
        assert server_results[request_id] == offline_results[request_id], request_id

    def seen(result: Result) -> tuple:
        return result.token_ids, result.text, result.finish_reason, result.stop_reason

    assert seen(server_results["stop"]) == seen(offline_results["stop"])
