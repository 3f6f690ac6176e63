"""Outputs with prefix caching equal outputs without it, token for token, on the real model."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams

pytest.importorskip("gguf")

SYSTEM = ("You are a meticulous assistant for a railway company. Answer briefly and precisely. "
          "Timetables: the 7:05 leaves from platform 2, the 8:40 from platform 5, the 12:15 from "
          "platform 1, and the 18:30 express from platform 7. Bicycles travel free outside rush hour. "
          "Dogs on a lead travel free. Season tickets are valid on all regional lines. ") * 3
QUESTIONS = ["When does the express leave?", "Can I bring my bike at 8:40?", "Which platform for 12:15?",
             "Is my dog allowed?", "Do season tickets work on regional lines?", "What leaves at 7:05?",
             "Say hello.", "Name one platform."]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def cached() -> LLM:
    return LLM(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return LLM(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory="512MiB",
               enable_prefix_caching=False)


def shared_prompts(llm: LLM) -> list[list[int]]:
    return [chat_ids(llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def test_shared_system_prompt(cached: LLM, uncached: LLM) -> None:
    prompts = shared_prompts(cached)
    expected = [o.token_ids for o in uncached.generate(prompts, GREEDY)]
    before = cached.engine.stats.num_prefix_hit_tokens
    # Once alone (fills the cache), then all together: later ones hit the shared system prompt.
    first = cached.generate(prompts[:1], GREEDY)
    together = cached.generate(prompts, GREEDY)
    assert first[0].token_ids == expected[0]
    assert [o.token_ids for o in together] == expected
    hits = cached.engine.stats.num_prefix_hit_tokens - before
    assert hits >= len(prompts) * 16 * (len(prompts[0]) // 32)  # most of each shared prefix
    assert all(o.metrics.num_cached_tokens > 0 for o in together)
    assert uncached.engine.stats.num_prefix_hit_tokens == 0


def test_conversation_growing_turn_by_turn(cached: LLM, uncached: LLM) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS[:5]):
        messages.append({"role": "user", "content": question})
        outs = [llm.generate([chat_ids(llm, messages)], GREEDY)[0] for llm in (cached, uncached)]
        assert outs[0].token_ids == outs[1].token_ids, f"turn {turn} differs"
        if turn > 0:
            assert outs[0].metrics.num_cached_tokens >= 16 * ((len(outs[0].prompt_token_ids) // 16) - 3)
        messages.append({"role": "assistant", "content": outs[1].text})


def test_shared_prefix_under_preemption(uncached: LLM) -> None:
    prompts = shared_prompts(uncached)
    expected = [o.token_ids for o in uncached.generate(prompts, GREEDY)]
    need = max(len(p) for p in prompts) + GREEDY.max_tokens
    # Room for the shared prefix plus a few private tails: not for all eight at once.
    small = LLM(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=-(-need // 16) + 6)
    outs = small.generate(prompts, GREEDY)
    assert small.engine.stats.num_preemptions > 0
    assert small.engine.stats.num_prefix_hit_tokens > 0
    assert [o.token_ids for o in outs] == expected
    small.engine.blocks.check_integrity()
    assert small.engine.blocks.num_used_blocks == 0


def test_prompts_sharing_an_uncached_prefix_sent_at_once_compute_it_once(uncached: LLM) -> None:
    """Eight prompts with one system prompt nobody computed yet, sent together, in chunks smaller than
    it: the later ones wait for the first to compute it and reuse it, whatever the admission order."""
    prompts = shared_prompts(uncached)
    expected = [o.token_ids for o in uncached.generate(prompts, GREEDY)]
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=96, min_prefill_chunk=16, kv_cache_memory="512MiB")
    stats = llm.engine.core.stats
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    prefix = next(i for i, tokens in enumerate(zip(*prompts)) if len(set(tokens)) > 1)
    distinct = prefix + sum(len(p) - prefix for p in prompts)
    assert prefix > 200 and stats.num_prefill_tokens <= 1.2 * distinct, (stats.num_prefill_tokens, distinct)
    assert sorted(o.metrics.num_cached_tokens for o in outs)[1:] == [16 * (prefix // 16)] * 7

    # n choices of one long prompt nobody computed yet: computed once too.
    prompt = chat_ids(llm, [{"role": "system", "content": SYSTEM[::-1]}, {"role": "user", "content": "Hi."}])
    before = stats.num_prefill_tokens
    (out,) = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
    assert len(out.outputs) == 4 and stats.num_prefill_tokens - before <= 1.2 * len(prompt)
