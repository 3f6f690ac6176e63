"""A draft model changes no output, only how soon it comes.

The pair: the bundled model's weights in float32 as the model, its own Q4_1 file as the draft (about a
fifth of the bytes a token streams, so guesses pay and the cost model grants them). Every request emits
the same tokens with the draft as without (greedy, seeded sampling, penalties, stop strings), in batches
with staggered joins; a draft of another vocabulary is refused at start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_batched_parity import assert_same_tokens, make_prompts, run_with_joins

from conveyor import LLM, SamplingParams
from conveyor.errors import ModelLoadError
from conveyor.model.checkpoint import resolve_model_path

pytest.importorskip("gguf")

NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
MODEL = dict(quantization="none", dtype="float32", max_num_seqs=8, kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def bundled() -> str:
    return str(resolve_model_path(None))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return ["def add(a, b):\n    return", "The capital of France is"] + make_prompts(4, seed=5)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**MODEL)


@pytest.fixture(scope="module")
def drafted(bundled: str) -> LLM:
    return LLM(speculative_model=bundled, num_speculative_tokens=4, **MODEL)


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts):
    return plain.generate(prompts, GREEDY, use_tqdm=False)


def test_greedy_batch_is_unchanged_and_guesses_are_taken(drafted: LLM, prompts, reference) -> None:
    before = drafted.engine.stats.num_accepted_tokens
    outputs = drafted.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_tokens(outputs, reference, "draft-model batch")
    stats = drafted.engine.stats
    # Guessing costs a forward of the draft per row: a batch takes few, but some.
    assert stats.num_accepted_tokens > before and stats.num_draft_tokens >= stats.num_accepted_tokens
    for output in outputs:   # one logprob per token, as without guesses
        assert [e.token_id for e in output.logprobs] == output.token_ids


def test_alone_and_staggered_joins_are_unchanged(drafted: LLM, prompts, reference) -> None:
    stats = drafted.engine.stats
    accepted, guessed = stats.num_accepted_tokens, stats.num_draft_tokens
    assert_same_tokens([drafted.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[:2]], reference[:2],
                       "draft-model alone")
    # The draft is the same weights rounded to 4 bits: most of its guesses hold.
    accepted, guessed = stats.num_accepted_tokens - accepted, stats.num_draft_tokens - guessed
    assert guessed > 0 and accepted >= 0.6 * guessed
    tokens = run_with_joins(drafted.engine, prompts, GREEDY, every=3, joining=2, prefix="join")
    for i, r in enumerate(reference):
        assert tokens[f"join{i}"] == r.token_ids, f"prompt {i} differs when joining beside a draft"


def test_seeded_sampling_penalties_and_stops_are_unchanged(plain: LLM, drafted: LLM, prompts) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=NUM_TOKENS,
                             repetition_penalty=1.1 if i % 2 else 1.0, stop=[" the"] if i == 1 else [])
              for i in range(len(prompts))]
    stats = drafted.engine.stats
    accepted, guessed = stats.num_accepted_tokens, stats.num_draft_tokens
    outputs = [drafted.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert_same_tokens(outputs, plain.generate(prompts, params, use_tqdm=False), "draft-model seeded")
    # Guesses drawn with a copy of the request's generator land where the model's draw lands: most
    # hold at temperature 0.8, where the draft's top token alone would often miss.
    accepted, guessed = stats.num_accepted_tokens - accepted, stats.num_draft_tokens - guessed
    print(f"seeded: {accepted}/{guessed} guesses held")
    assert guessed > 0 and accepted >= 0.7 * guessed


def test_a_draft_of_another_vocabulary_is_refused(bundled: str, tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not share the model's vocabulary"):
        LLM(model=bundled, speculative_model=str(tiny_llama), kv_cache_memory="64MiB")


def test_a_missing_draft_is_a_clear_start_up_error(bundled: str, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist: .*no-draft.gguf"):
        LLM(model=bundled, speculative_model=str(tmp_path / "no-draft.gguf"), kv_cache_memory="64MiB")


def test_folder_pair_with_a_poor_draft_is_unchanged(tiny_llama: Path, tiny_qwen2: Path) -> None:
    """Another family with random weights guesses badly; the model's output is still its own."""
    prompts = ["hello world", "the cat sat"]
    plain = LLM(model=str(tiny_llama), kv_cache_memory="64MiB").generate(prompts, GREEDY, use_tqdm=False)
    drafted = LLM(model=str(tiny_llama), speculative_model=str(tiny_qwen2), kv_cache_memory="64MiB")
    assert_same_tokens(drafted.generate(prompts, GREEDY, use_tqdm=False), plain, "poor draft")


def test_the_draft_reads_prompt_chunks_as_the_model_computes_them(bundled: str) -> None:
    """A prompt computed in chunks is in the draft's cache by its first token: no step catches up on it."""
    llm = LLM(speculative_model=bundled, max_num_batched_tokens=16, **{**MODEL, "max_num_seqs": 2})
    engine = llm.engine
    prompt = engine.encode_prompt("def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n"
                                  "            print('FizzBuzz')\n        elif i % 3 == 0:\n")
    assert len(prompt) > 32
    engine.add_request(prompt, GREEDY, request_id="long")
    while not engine.core.scheduler.requests["long"].output_token_ids:
        engine.step()
    assert engine.core.draft._states["long"].token_ids == prompt
    reference = LLM(max_num_batched_tokens=16, **MODEL).generate([prompt], GREEDY, use_tqdm=False)[0]
    tokens = list(engine.core.scheduler.requests["long"].output_token_ids)
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens[:len(reference.token_ids)] == reference.token_ids


def test_unseeded_sampling_guesses_are_drawn_with_the_models_noise(drafted: LLM, prompts) -> None:
    """An unseeded random request gets a generator of its own beside a draft, so its guesses couple too."""
    stats = drafted.engine.stats
    accepted, guessed = stats.num_accepted_tokens, stats.num_draft_tokens
    params = SamplingParams(temperature=0.8, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = [drafted.generate([p], params, use_tqdm=False)[0] for p in prompts[:3]]
    assert all(len(o.token_ids) == NUM_TOKENS for o in outputs)
    accepted, guessed = stats.num_accepted_tokens - accepted, stats.num_draft_tokens - guessed
    assert guessed > 0 and accepted >= 0.75 * guessed


def test_a_prompt_found_in_the_prefix_cache_is_taken_up_near_where_the_model_starts(drafted: LLM) -> None:
    """The second time, a long prompt's blocks come from the prefix cache: the draft reads only the last
    512 tokens before the model's first computed one (not the whole prompt), and its guesses still hold."""
    engine = drafted.engine
    prompt = "def add(a, b):\n    return a + b\n\n" * 70
    num_prompt = len(engine.encode_prompt(prompt))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = drafted.generate([prompt], params, use_tqdm=False)[0]
    engine.add_request(prompt, params, request_id="again")
    tokens = []
    while "again" not in engine.core.draft._states:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    state = engine.core.draft._states["again"]
    assert num_prompt > 600 and state.offset > 0 and len(state.token_ids) <= 512 + 16
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == first.token_ids
