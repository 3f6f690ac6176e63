"""Engine options a vLLM user reaches for: an engine-wide seed, a chat template of one's own, and the
outputs in vLLM's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams
from conveyor.errors import InvalidRequest

SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["the quick brown fox", "hello there", "one two three"]


def sample(tiny_checkpoint: Path, seed: int | None) -> list[list[int]]:
    llm = LLM(str(tiny_checkpoint), seed=seed, kv_cache_memory="32MiB", threads=1)
    return [o.token_ids for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]


def test_same_engine_seed_same_unseeded_samples(tiny_checkpoint: Path) -> None:
    first = sample(tiny_checkpoint, seed=7)
    assert sample(tiny_checkpoint, seed=7) == first
    assert sample(tiny_checkpoint, seed=8) != first


def test_outputs_in_vllm_shape(tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint), kv_cache_memory="32MiB", threads=1)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].text == out.text and out.outputs[0].token_ids == out.token_ids


def test_n_choices_offline_compute_the_prompt_once(tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint), kv_cache_memory="32MiB", threads=1, block_size=16)
    prompt = list(range(10, 74))   # four full blocks
    stats = llm.engine.core.stats
    before = (stats.num_prefill_tokens, stats.num_prefix_hit_tokens)
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs) == 3
    # The two later choices find the first's blocks cached: 64 prompt tokens computed, not 3 x 64.
    assert stats.num_prefix_hit_tokens - before[1] >= 2 * 48
    assert stats.num_prefill_tokens - before[0] <= 64 + 2 * 16


def test_n_choices_offline_in_vllm_shape(tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint), kv_cache_memory="32MiB", threads=1)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["hello", "the sky"], params, use_tqdm=False)
    assert [len(out.outputs) for out in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1       # seed + j: the choices differ
    again = llm.generate(["hello", "the sky"], params, use_tqdm=False)
    assert [[c.token_ids for c in out.outputs] for out in again] == [[c.token_ids for c in out.outputs] for out in outs]
    single = SamplingParams(temperature=1.0, seed=12, max_tokens=6, ignore_eos=True)
    assert llm.generate(["hello"], single, use_tqdm=False)[0].token_ids == outs[0].outputs[1].token_ids
    with pytest.raises(InvalidRequest):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(InvalidRequest):
        llm.engine.add_request("hi", SamplingParams(n=2))


def test_chat_template_from_a_string_or_a_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    llm = LLM(str(tiny_checkpoint), chat_template=template, kv_cache_memory="32MiB", threads=1)
    assert llm.tokenizer.apply_chat_template(messages) == "<user>hi"
    file = tmp_path / "template.jinja"
    file.write_text(template.replace("<", "["), encoding="utf-8")
    llm = LLM(str(tiny_checkpoint), chat_template=str(file), kv_cache_memory="32MiB", threads=1)
    assert llm.tokenizer.apply_chat_template(messages) == "[user>hi"
    with pytest.raises(ValueError, match="does not parse"):
        LLM(str(tiny_checkpoint), chat_template="{% for m in messages %}", kv_cache_memory="32MiB", threads=1)
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tiny_checkpoint), chat_template=str(tmp_path / "missing.jinja"), kv_cache_memory="32MiB", threads=1)
