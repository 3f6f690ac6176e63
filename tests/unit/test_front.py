"""The front's half of the core split, without a model: admission, text from token deltas, the busy loop."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from helpers import RecordingClient, tiny_bpe_tokenizer

from conveyor.config import SchedulerConfig
from conveyor.front.admission import check_request
from conveyor.front.front import Choices, Front
from conveyor.front.async_engine import AsyncEngine
from conveyor.engine.core_client import IDLE_WAIT_S, run_busy_loop
from conveyor.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreCommand,
    CoreInfo,
    CoreLoad,
    CoreRequest,
    FinishRequests,
    RequestMetrics,
    Shutdown,
    StepOutputs,
    TokenDelta,
)
from conveyor.front.output_processor import OutputProcessor
from conveyor.text.tokenizer import Tokenizer
from conveyor.errors import ContextLengthExceeded, InvalidRequest, QueueFull
from conveyor.logprobs import PromptLogprob, TokenLogprobs
from conveyor.sampling_params import SamplingParams

INFO = CoreInfo(vocab_size=300, max_model_len=64, num_kv_blocks=3, block_size=16, startup_s=0.0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_bpe_tokenizer()


# ------------------------------------------------------------------ admission


@pytest.mark.parametrize("prompt,max_tokens,error,param", [
    ([], 4, InvalidRequest, "prompt"),
    ([1, 300], 4, InvalidRequest, "prompt"),
    ([1, True], 4, InvalidRequest, "prompt"),
    ([1] * 64, None, ContextLengthExceeded, "prompt"),
    ([1] * 40, 30, ContextLengthExceeded, "max_tokens"),   # 70 tokens pass the model length of 64
    ([1] * 40, 10, ContextLengthExceeded, "max_tokens"),   # 50 tokens need 4 blocks of 16; the cache has 3
    ([1] * 64, 5, ContextLengthExceeded, "prompt"),        # the prompt alone is too long, whatever max_tokens
    ([1] * 48, 1, ContextLengthExceeded, "prompt"),        # the prompt plus one token outgrows the cache
])
def test_admission_refuses_what_could_never_run(prompt: list, max_tokens: int | None, error: type,
                                                 param: str) -> None:
    with pytest.raises(error) as caught:
        check_request(prompt, SamplingParams(max_tokens=max_tokens), INFO)
    assert caught.value.param == param


def test_admission_refuses_stop_token_ids_outside_the_vocabulary() -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_request([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[5, 10**12]), INFO)
    assert caught.value.param == "stop_token_ids" and str(10**12) in caught.value.message
    check_request([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[0, 299]), INFO)


def test_admission_accepts_a_request_that_fits_exactly() -> None:
    assert check_request([1] * 40, SamplingParams(max_tokens=8), INFO) == 8
    assert check_request([1] * 47, SamplingParams(max_tokens=None), dataclasses.replace(INFO, num_kv_blocks=4)) == 17


def test_admission_resolves_max_tokens_none_to_what_the_model_length_leaves() -> None:
    info = dataclasses.replace(INFO, num_kv_blocks=4)   # the cache holds the whole model length
    assert check_request([1] * 30, SamplingParams(max_tokens=None), info) == info.max_model_len - 30
    assert check_request([1] * 30, SamplingParams(max_tokens=5), info) == 5


@pytest.mark.parametrize("max_waiting,num_accepted", [(1, 3), (0, 2)])
def test_capacity_check_and_start_are_one_step(tokenizer: Tokenizer, max_waiting: int, num_accepted: int) -> None:
    """Requests added back to back, before the core reports anything, cannot all pass the check:
    two batch slots plus `max_waiting` may be taken, the next is a 429 (0 = only what can start now)."""
    info = dataclasses.replace(INFO, scheduler=SchedulerConfig(max_num_seqs=2))
    client = RecordingClient(info)
    engine = AsyncEngine(client, tokenizer, max_waiting_requests=max_waiting)  # type: ignore[arg-type]
    for i in range(num_accepted):
        engine.add([[1, 2]], SamplingParams(max_tokens=2), [f"r{i}"])
    with pytest.raises(QueueFull):
        engine.add([[1, 2]], SamplingParams(max_tokens=2), ["late"])
    with pytest.raises(QueueFull):   # a batch prompt is admitted whole or not at all
        AsyncEngine(client, tokenizer, max_waiting_requests=max_waiting).add(  # type: ignore[arg-type]
            [[1]] * (num_accepted + 1), SamplingParams(max_tokens=2), [f"b{i}" for i in range(num_accepted + 1)])
    assert [len(c.requests) for c in client.sent] == [1] * num_accepted


# ------------------------------------------------------------------ output processor


def test_text_deltas_add_up_to_the_decoded_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the quick brown fox")
    processor = OutputProcessor(tokenizer)
    processor.add("r", [1], SamplingParams())
    texts = [processor.process(TokenDelta("r", [t])).new_text for t in ids[:-1]]
    last = processor.process(TokenDelta("r", [ids[-1]], finish_reason="length"))
    assert "".join(texts) + last.new_text == "the quick brown fox"
    assert last.finished and last.finish_reason == "length" and last.prompt_token_ids == [1]
    assert len(processor) == 0 and processor.process(TokenDelta("r", [ids[0]])) is None


def step_of(*deltas: TokenDelta) -> StepOutputs:
    return StepOutputs(list(deltas), CoreLoad(0, 0, 0, 0.0))


def test_stop_string_ends_the_request_and_asks_the_core_to_finish_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the quick brown fox jumps")
    client = RecordingClient(INFO)
    front = Front(tokenizer, INFO, client.send)
    assert front.start([CoreRequest("r", [1], SamplingParams(stop=["brown"]), 16, frozenset(), 0.0)]) == []
    outputs = []
    for token_id in ids:
        texts, rejected = front.process(step_of(TokenDelta("r", [token_id])))
        outputs += texts
        assert rejected == []
    assert "".join(o.new_text for o in outputs) == "the quick "
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == "brown"
    assert client.sent[1:] == [FinishRequests([("r", "brown")])]   # once: later deltas are not its
    assert len(front.processor) == 0


def test_a_stop_string_in_the_last_delta_needs_no_finish_command(tokenizer: Tokenizer) -> None:
    client = RecordingClient(INFO)
    front = Front(tokenizer, INFO, client.send)
    front.start([CoreRequest("r", [1], SamplingParams(stop=["fox"], include_stop_str_in_output=True), 16,
                             frozenset(), 0.0)])
    [output], _ = front.process(step_of(TokenDelta("r", tokenizer.encode("brown fox jumps"), finish_reason="length")))
    assert output.new_text == "brown fox" and output.finish_reason == "stop"
    assert [type(command) for command in client.sent] == [AddRequests]


def test_error_delta_carries_its_message(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add("r", [1], SamplingParams())
    output = processor.process(TokenDelta("r", [], finish_reason="error", error="boom"))
    assert output.finished and output.error == "boom"


# ------------------------------------------------------------------ messages and the busy loop


def test_messages_survive_pickling() -> None:
    outputs = StepOutputs([TokenDelta("r", [5], finish_reason="stop", stop_reason=7),
                           TokenDelta("s", [6, 7], [TokenLogprobs(6, -0.5, [(6, -0.5)]), TokenLogprobs(7, -1.0, [])],
                                      error="boom", prompt_logprobs=[None, PromptLogprob(-2.0, 1, [(3, -2.0)])],
                                      metrics=RequestMetrics(1.0, 1.5, 2.0, 3.0, 4, 2, 0, 0))],
                          CoreLoad(1, 2, 3, 0.5), rejected=[("q", QueueFull("full"))], num_added=2)
    again = pickle.loads(pickle.dumps(outputs))
    assert again.deltas == outputs.deltas and again.load == outputs.load and again.num_added == 2
    (request_id, error), = again.rejected
    assert request_id == "q" and isinstance(error, QueueFull) and error.status == 429 and error.message == "full"


class FakeCore:
    """Runs each request for `steps` steps; records what the loop asked of it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.left: dict[str, int] = {}
        self.handled: list[type] = []
        self.news = False
        self.fatal_error: str | None = None
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def has_news(self) -> bool:
        return self.news

    def handle(self, command: CoreCommand) -> None:
        self.handled.append(type(command))
        self.news = True
        if isinstance(command, AddRequests):
            for request in command.requests:
                self.left[request.request_id] = self.steps
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self.left.pop(request_id, None)

    def step_or_fail(self) -> StepOutputs:
        self.news = False
        deltas = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            if done:
                del self.left[request_id]
            deltas.append(TokenDelta(request_id, [1], finish_reason="length" if done else None))
        return StepOutputs(deltas, CoreLoad(len(self.left), 0, 0, 0.0))


def test_busy_loop_steps_without_waiting_while_busy_and_stops_on_shutdown() -> None:
    add = AddRequests([CoreRequest("a", [1], SamplingParams(), 16, frozenset(), 0.0)])
    inbox: list[list[CoreCommand]] = [[add], [], [], [AbortRequests(["unknown"])], [Shutdown()]]
    timeouts: list[float] = []
    sent: list[StepOutputs] = []

    def receive(timeout_s: float) -> list[CoreCommand]:
        timeouts.append(timeout_s)
        return inbox.pop(0)

    core = FakeCore(steps=2)
    run_busy_loop(core, receive, sent.append)  # type: ignore[arg-type]
    assert [[d.finished for d in s.deltas] for s in sent] == [[False], [True], []]
    assert timeouts == [IDLE_WAIT_S, 0.0, IDLE_WAIT_S, IDLE_WAIT_S, IDLE_WAIT_S]   # waits only when idle
    assert core.handled == [AddRequests, AbortRequests]
    assert core.closed   # what the core started beside itself stops with the loop


# ------------------------------------------------------------------ a prompt's n choices (both faces)


def test_choices_start_the_first_now_and_the_rest_after_its_first_output() -> None:
    choices = Choices(SamplingParams(n=3, best_of=3, seed=7), stagger=True)
    [(index, first)] = choices.start_now()
    assert (index, first.n, first.best_of, first.seed) == (0, 1, None, 7)
    later = choices.start_after_first_output()
    assert [(j, p.n, p.seed) for j, p in later] == [(1, 1, 8), (2, 1, 9)]
    assert choices.start_after_first_output() == []


def test_choices_without_stagger_all_start_now_and_seeds_wrap() -> None:
    choices = Choices(SamplingParams(n=2, seed=2**64 - 1), stagger=False)
    assert [(j, p.seed) for j, p in choices.start_now()] == [(0, 2**64 - 1), (1, 0)]
    assert choices.start_after_first_output() == []
    assert [p.seed for _, p in Choices(SamplingParams(n=2), stagger=False).start_now()] == [None, None]
