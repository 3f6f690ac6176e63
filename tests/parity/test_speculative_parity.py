"""Speculative decoding changes no output: on the real model, every request emits the same tokens
with n-gram speculation on as off (greedy, seeded sampling, penalties, min_tokens, stop strings),
in batches with staggered joins, preemption and prefix-cache hits."""

from __future__ import annotations

import pytest
from test_batched_parity import assert_same_tokens, make_prompts, run_with_joins

from conveyor import LLM, SamplingParams

pytest.importorskip("gguf")

NUM_TOKENS = 32
# Text that repeats itself, so lookups find guesses, and plain sentences, where they mostly miss.
REPEATING = [
    "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue, red, green,",
    "Say it again and again: the cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)


def speculating(**options) -> LLM:
    return LLM(speculative="ngram", num_speculative_tokens=4, ngram_prompt_lookup_min=1, **options)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return REPEATING + make_prompts(8, seed=3)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(max_num_seqs=16, kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def spec() -> LLM:
    return speculating(max_num_seqs=16, kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts):
    return plain.generate(prompts, GREEDY, use_tqdm=False)


def mismatches(outputs, reference) -> int:
    return sum(o.token_ids != r.token_ids for o, r in zip(outputs, reference))


def test_greedy_batch_is_unchanged_and_guesses_are_taken(spec: LLM, prompts, reference) -> None:
    outputs = spec.generate(prompts, GREEDY, use_tqdm=False)
    print(f"mismatches={mismatches(outputs, reference)}")
    assert_same_tokens(outputs, reference, "speculative batch")
    for o, r in zip(outputs, reference):   # one logprob per token, the same as without guesses
        assert [e.token_id for e in o.logprobs] == o.token_ids
        assert [e.logprob for e in o.logprobs] == pytest.approx([e.logprob for e in r.logprobs], abs=1e-4)
    # Whether a batch of 12 guesses at all depends on the step costs the engine has measured (a guess must
    # pay for itself, and on a loaded host a batch's may not): that guesses are taken and held is checked
    # where one nearly always pays, the repeating prompts one at a time.
    before = spec.engine.stats.num_accepted_tokens
    for prompt, ref in zip(REPEATING, reference):
        assert spec.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == ref.token_ids
    stats = spec.engine.stats
    assert stats.num_accepted_tokens > before and stats.num_draft_tokens >= stats.num_accepted_tokens


def test_greedy_alone_is_unchanged(spec: LLM, prompts, reference) -> None:
    alone = [spec.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[:4]]
    assert_same_tokens(alone, reference[:4], "speculative alone")


def test_staggered_joins_are_unchanged(spec: LLM, prompts, reference) -> None:
    tokens = run_with_joins(spec.engine, prompts, GREEDY, every=4, joining=2, prefix="join")
    for i, r in enumerate(reference):
        assert tokens[f"join{i}"] == r.token_ids, f"prompt {i} differs when joining mid-generation"


def test_preemption_and_prefix_hits_are_unchanged(prompts, reference) -> None:
    total = [len(r.prompt_token_ids) + NUM_TOKENS for r in reference]
    blocks = sum(-(-t // 16) for t in total) // 3
    llm = speculating(max_num_seqs=16, num_kv_blocks=blocks)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    assert_same_tokens(outputs, reference, "speculative, preempting")
    again = llm.generate(prompts[:4], GREEDY, use_tqdm=False)    # their prompts are now cached
    assert llm.engine.stats.num_prefix_hit_tokens > 0
    assert_same_tokens(again, reference[:4], "speculative, prefix hits")


def test_seeded_sampling_penalties_and_min_tokens_are_unchanged(plain: LLM, spec: LLM, prompts) -> None:
    params = [SamplingParams(temperature=0.8, top_k=40, seed=7 + i, max_tokens=24, ignore_eos=True)
              for i in range(4)]
    params += [SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=24),
               SamplingParams(temperature=0, min_tokens=20, max_tokens=24, presence_penalty=0.4)]
    chosen = prompts[:4] + prompts[:2]
    want = [o.token_ids for o in plain.generate(chosen, params, use_tqdm=False)]
    accepted = spec.engine.stats.num_accepted_tokens
    got = [o.token_ids for o in spec.generate(chosen, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.stats.num_accepted_tokens > accepted


def test_stop_strings_inside_a_guessed_run(plain: LLM, spec: LLM) -> None:
    prompt = REPEATING[0]   # greedy goes on " blue, red, green, blue, red, green, ..."
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, stop=["green, blue, red, gr"],
                            include_stop_str_in_output=True)
    want = plain.generate([prompt], params, use_tqdm=False)[0]
    accepted = spec.engine.stats.num_accepted_tokens
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert want.finish_reason == "stop" and want.text.endswith("green, blue, red, gr")
    assert spec.engine.stats.num_accepted_tokens > accepted
