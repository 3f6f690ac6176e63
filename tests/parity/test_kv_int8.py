"""The 8-bit KV cache on the bundled model: batched == alone, greedy tokens close to float16's, ~1.94x the
tokens in the same memory, and the disk tier's files round trip (and an int8 file is a float16 miss)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams
from conveyor.cli.flags import engine_options, parse_args
from conveyor.config import CacheConfig, EngineConfig
from conveyor.runtime.runtime_builder import build_runtime

pytest.importorskip("gguf")

GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
             "Write one sentence about the moon.", "What is 12 times 12?", "Translate 'good morning' into Spanish."]
TEXT = ("A ledger of the harbour: the Aurora unloads grain at berth 3, the Kestrel takes on timber at "
        "berth 5, the pilot boat waits by the north mole, and the tide turns at four. ") * 5


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.tokenizer
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS]


def generate(llm: LLM, prompts: list) -> list[list[int]]:  # noqa: ANN001
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY_16, use_tqdm=False)]


@pytest.fixture(scope="module")
def int8() -> LLM:
    return LLM(kv_cache_memory="64MiB", kv_cache_dtype="int8", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def float16() -> LLM:
    return LLM(kv_cache_memory="64MiB", kv_cache_dtype="float16", max_num_batched_tokens=256)


def test_q8_0_is_int8() -> None:
    assert CacheConfig(kv_cache_dtype="q8_0").kv_cache_dtype == "int8"
    for spelling in ("q8_0", "int8"):
        options = engine_options(parse_args(["serve", "--kv-cache-dtype", spelling]))
        assert EngineConfig.from_options(**options).cache.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="q4_0")


@pytest.mark.parametrize("options,where", [(dict(device="cuda", dtype="float16"), "a GPU"),
                                           (dict(tensor_parallel_size=2), "tensor_parallel_size")])
def test_where_int8_is_not_yet_it_is_refused_at_start_up(options: dict, where: str) -> None:
    with pytest.raises(ValueError, match=f"not yet on {where}"):
        build_runtime(EngineConfig.from_options(kv_cache_dtype="int8", **options))


def test_batched_equals_alone(int8: LLM) -> None:
    prompts = chat_prompts(int8)[:4] + [int8.tokenizer.encode(TEXT)]   # a 200-token prompt: chunked
    batched = generate(int8, prompts)
    assert batched == [generate(int8, [p])[0] for p in prompts]


def test_greedy_tokens_mostly_equal_the_float16_caches(int8: LLM, float16: LLM) -> None:
    prompts = chat_prompts(int8)
    ours, theirs = generate(int8, prompts), generate(float16, prompts)
    first_difference = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
    print("first differing token per prompt (None: all 16 equal):", first_difference)
    assert sum(d is None for d in first_difference) > len(prompts) / 2, first_difference


def test_the_same_memory_holds_1_9x_the_tokens(int8: LLM, float16: LLM) -> None:
    ours, theirs = int8.engine.core.info, float16.engine.core.info
    assert ours.kv_cache_dtype == "int8" and theirs.kv_cache_dtype == "float16"
    assert ours.num_kv_blocks >= 1.9 * theirs.num_kv_blocks
    assert ours.kv_cache_bytes <= 64 * 2**20


def test_disk_tier_round_trip_and_a_float16_miss(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    options = dict(prefix_cache_dir=str(folder), kv_cache_memory="16MiB", max_num_batched_tokens=512)
    first = LLM(kv_cache_dtype="int8", **options)
    prompt = first.tokenizer.encode(TEXT)
    tokens = generate(first, [prompt])
    first.engine.core.close()   # the writer finishes what it has queued
    again = LLM(kv_cache_dtype="q8_0", **options)   # a restart
    assert generate(again, [prompt]) == tokens
    assert again.engine.stats.disk.num_hit_tokens == (len(prompt) - 1) // 16 * 16
    again.engine.core.close()
    other = LLM(kv_cache_dtype="float16", **options)
    generate(other, [prompt])
    assert other.engine.stats.disk.num_hit_tokens == 0
    other.engine.core.close()
    assert len({p.parent for p in folder.glob("*/*.kv")}) == 2   # each KV dtype has a folder of its own
