"""Tensor parallelism: two ranks (gloo on loopback) give the tokens one rank gives, and a rank that
dies takes the engine down with an error for every request instead of a hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams, kernels

PROMPTS = ["hello world", "the capital of France", "def main():\n", "a b c d e f g", "user: hi"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(kv_cache_memory="16MiB", dtype="float32")


def greedy_tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


# llama: 4 heads over 2 KV heads, tied output layer; llama_untied: its own (vocabulary-parallel)
# output layer and llama3 RoPE; llama_kv3: 6 heads over 3 KV heads, which two ranks cannot split evenly.
@pytest.mark.parametrize("name", ["llama", "llama_untied", "llama_kv3"])
def test_two_ranks_give_the_tokens_of_one(name: str, tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    path = str(tiny_checkpoint_factory(name))
    want = greedy_tokens(LLM(path, threads=1, **ENGINE), PROMPTS)
    parallel = LLM(path, threads=2, tensor_parallel_size=2, **ENGINE)
    if kernels.library() is not None:   # the hidden states are summed in shared memory, not over TCP
        assert parallel.engine.core.runner.comm.shm is not None
    try:
        assert greedy_tokens(parallel, PROMPTS) == want                 # a batch, prompts prefilled together
        assert [greedy_tokens(parallel, [p])[0] for p in PROMPTS[:2]] == want[:2]   # one at a time
    finally:
        parallel.engine.core.close()
    assert all(worker.poll() is not None for worker in parallel.engine.core.runner.workers)


def test_a_lost_rank_stops_the_core_at_once(tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    from conveyor.engine.core_client import run_busy_loop
    from conveyor.engine.messages import AddRequests, CoreRequest
    from conveyor.runtime.tensor_parallel import WorkerLost

    parallel = LLM(str(tiny_checkpoint_factory("llama")), threads=2, tensor_parallel_size=2, **ENGINE)
    core = parallel.engine.core
    worker = core.runner.workers[0]
    worker.kill()
    worker.wait()
    request = CoreRequest("r1", parallel.engine.encode_prompt("hello world"), GREEDY, GREEDY.max_tokens,
                          parallel.engine.tokenizer.eos_token_ids, time.monotonic())
    commands = [[AddRequests([request])]]
    started = time.monotonic()
    with pytest.raises(WorkerLost, match="rank 1 exited"):   # the core's thread or process ends on it
        run_busy_loop(core, lambda _timeout: commands.pop() if commands else [], lambda _outputs: None)
    assert time.monotonic() - started < 30
