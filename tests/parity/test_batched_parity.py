"""Batched greedy output equals one-request-at-a-time output, token for token, on the real model."""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from conveyor.front.llm_engine import LLMEngine

pytest.importorskip("gguf")

NUM_TOKENS = 24
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, Apollo 11 landed on the Moon, and",
    "List three uses of copper:",
    "Bonjour, comment allez-vous aujourd'hui ?",
    "The mitochondria is the powerhouse of the cell because",
    "Explain continuous batching in one sentence.",
]


def make_prompts(n: int = 16, seed: int = 0) -> list[str]:
    """Mixed lengths: from a few tokens to a few hundred."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        repeat = [1, 2, 5, 12, 30][i % 5]
        prompts.append(" ".join(rng.choice(SENTENCES) for _ in range(repeat)))
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)


def assert_same_tokens(batched, alone, label: str) -> None:
    """On a mismatch, name the request and step, and the top-2 logit gap there (alone run)."""
    for i, (b, a) in enumerate(zip(batched, alone)):
        if b.token_ids == a.token_ids:
            continue
        step = next(j for j, (x, y) in enumerate(zip(b.token_ids, a.token_ids)) if x != y)
        top = a.logprobs[step].top if a.logprobs else []
        gap = top[0][1] - top[1][1] if len(top) >= 2 else float("nan")
        pytest.fail(f"{label}: prompt {i} diverges at output step {step}: batched {b.token_ids[step]} vs "
                    f"alone {a.token_ids[step]}; top-2 logit gap alone = {gap:.2e} "
                    f"({'a numerical near-tie' if gap < 1e-3 else 'a bookkeeping bug'})")


@pytest.fixture(scope="module")
def roomy() -> LLM:
    return LLM(max_num_seqs=16, max_num_batched_tokens=4096, kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return make_prompts()


@pytest.fixture(scope="module")
def alone(roomy: LLM, prompts: list[str]):
    return [roomy.generate([p], GREEDY)[0] for p in prompts]


def test_roomy_budgets(roomy: LLM, prompts, alone) -> None:
    batched = roomy.generate(prompts, GREEDY)
    assert_same_tokens(batched, alone, "roomy")
    assert roomy.engine.stats.avg_rows_per_step > 1


def test_chunked_prefill(prompts, alone) -> None:
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=48, kv_cache_memory="512MiB")
    batched = llm.generate(prompts, GREEDY)
    assert_same_tokens(batched, alone, "chunked")


def test_chunks_cut_by_a_latency_target(prompts, alone) -> None:
    """A target no step can meet: while anything decodes, prompts move min_prefill_chunk tokens a step."""
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=4096, kv_cache_memory="512MiB", target_itl_ms=0.001,
              min_prefill_chunk=7)
    plans = record_plans(llm)
    # Staggered lengths free the 4 slots at different steps, so prompts start while others decode.
    lengths = [NUM_TOKENS - 5 * (i % 4) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    batched = llm.generate(prompts, params)
    for i, (b, a, n) in enumerate(zip(batched, alone, lengths)):
        assert b.token_ids == a.token_ids[:n], f"prompt {i} differs with latency-cut chunks"
    # Chunks longer than one token, in steps that also decode (a prompt's last token rides with the decodes).
    cut = [sum(r.num_tokens for r in plan.rows if r.num_tokens > 1) for plan in plans
           if any(not r.is_prefill for r in plan.rows)]
    assert max(cut) == 7


def test_preemption(prompts, alone) -> None:
    total = [len(o.prompt_token_ids) + NUM_TOKENS for o in alone]
    blocks = sum(-(-t // 16) for t in total) // 3   # about a third of what all need at once
    assert blocks * 16 >= max(total)
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=blocks)
    batched = llm.generate(prompts, GREEDY)
    assert llm.engine.stats.num_preemptions > 0
    assert_same_tokens(batched, alone, "preempting")


def test_short_prompts_go_ahead_of_a_long_prompts_chunks(prompts, alone) -> None:
    """Shorter prompts that arrive while a long one is computed in chunks are admitted ahead of its
    next chunk; same tokens as alone."""
    by_length = sorted(range(len(prompts)), key=lambda i: len(alone[i].prompt_token_ids))
    longest, others = by_length[-1], by_length[:5]
    # The target cuts the long chunk in the steps that carry a short prompt's first token.
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=64, min_prefill_chunk=8, kv_cache_memory="512MiB",
              target_itl_ms=50.0, enable_prefix_caching=False)
    plans = record_plans(llm)
    engine = llm.engine
    engine.add_request(prompts[longest], GREEDY, request_id=f"r{longest}")
    tokens: dict[str, list[int]] = {}
    for out in engine.step():   # the long prompt's first chunk
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i in others:
        engine.add_request(prompts[i], GREEDY, request_id=f"r{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i in [longest, *others]:
        assert tokens[f"r{i}"] == alone[i].token_ids, f"prompt {i} differs"
    second = [row.request_id for row in plans[1].rows]
    assert second[-1] == f"r{longest}" and len(second) > 1 and not plans[1].rows[-1].is_sampling


def record_plans(llm: LLM) -> list:
    """Every plan the engine's scheduler makes from now on, in order."""
    plans = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    llm.engine.scheduler.schedule = recording_schedule
    return plans


def run_with_joins(engine: LLMEngine, prompts: list[str], params: SamplingParams, every: int, joining: int,
                   prefix: str) -> dict[str, list[int]]:
    """`joining` requests join every `every` steps while the others run; tokens by request id."""
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    finished = step = 0
    while finished < len(prompts):
        if step % every == 0:
            for _ in range(joining):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(p, params, request_id=f"{prefix}{i}")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished += out.finished
        step += 1
    return tokens


def test_requests_join_mid_generation(roomy: LLM, prompts, alone) -> None:
    tokens = run_with_joins(roomy.engine, prompts, GREEDY, every=3, joining=3, prefix="r")
    for i, a in enumerate(alone):
        assert tokens[f"r{i}"] == a.token_ids, f"prompt {i} differs when joining mid-generation"


def test_seeded_sampling_same_alone_and_batched(roomy: LLM, prompts) -> None:
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(6)]
    alone = [roomy.generate([p], s)[0].token_ids for p, s in zip(prompts[:6], seeded)]
    mixed_params = seeded + [SamplingParams(temperature=1.0, max_tokens=16)] * 4
    batched = roomy.generate(prompts[:10], mixed_params)
    assert [o.token_ids for o in batched[:6]] == alone
