"""The engine with `attention_backend="flex"` on the CPU (FlexAttention's block masks, evaluated
densely): greedy tokens equal the SDPA path's, batched equal alone, across chunked prompts, a cached
prefix, GQA and sliding windows; the CUDA-graph decode path's static inputs build the same masks.
On a CUDA GPU (skipped elsewhere): the compiled kernel, decode steps replayed from CUDA graphs, gives
the SDPA path's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.cli.flags import engine_options, parse_args
from conveyor.config import EngineConfig, ModelConfig
from conveyor.runtime.cuda_graphs import DecodeGraphs
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.model_runner import ModelRunner

NUM_TOKENS = 16
PROMPT_LENS = (3, 17, 40, 9, 33, 5)   # contexts cross 1, 2, 4 blocks of 16 while decoding
# Small caches: on the CPU every query scores every key of the cache.
ENGINE = dict(dtype="float32", max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=48, block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    return prompts + [prompts[2] + prompts[0]]   # its first 32 tokens are cached blocks once prompt 2 ran


@pytest.mark.parametrize("family", ("qwen2", "mistral", "gemma3"))   # GQA, a window on every layer, mixed windows
def test_flex_gives_the_sdpa_paths_tokens_batched_and_alone(family: str,
                                                             tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    folder = str(tiny_checkpoint_factory(family))
    sdpa, flex = LLM(folder, attention_backend="sdpa", **ENGINE), LLM(folder, attention_backend="flex", **ENGINE)
    assert flex.engine.core.runner.flex_cache_blocks == 48 and sdpa.engine.core.runner.flex_cache_blocks == 0
    prompts = _prompts(flex.engine.core.model.arch.vocab_size)
    want = [o.token_ids for o in sdpa.generate(prompts, GREEDY)]
    assert [o.token_ids for o in flex.generate(prompts, GREEDY)] == want
    assert [flex.generate([p], GREEDY)[0].token_ids for p in prompts] == want


def test_the_bundled_model_with_its_16_bit_cache_gives_the_sdpa_tokens() -> None:
    """The real file: quantized weights, float32 activations beside a float16 KV cache, 30 layers, GQA."""
    pytest.importorskip("gguf")
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three uses of copper:"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine = dict(kv_cache_memory="24MiB", max_num_batched_tokens=32)
    want = LLM(attention_backend="sdpa", **engine).generate(prompts, params)
    flex = LLM(attention_backend="flex", **engine)
    assert flex.engine.core.kv_cache.dtype == torch.float16
    got = flex.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # Both read the float16 cache as float32: the logprobs agree far below float16's own rounding.
    for ours, theirs in zip(got, want):
        assert [p.top[0][1] for p in ours.logprobs] == pytest.approx([p.top[0][1] for p in theirs.logprobs], abs=1e-4)


def test_graph_inputs_build_the_same_masks(tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    """DecodeGraphs with flex off a GPU: the same static inputs run eagerly, in buckets of 2 rows and
    2 blocks at least; tokens equal the plain flex engine's."""
    folder = str(tiny_checkpoint_factory("gemma3"))
    plain, graphed = LLM(folder, attention_backend="flex", **ENGINE), LLM(folder, attention_backend="flex", **ENGINE)
    core = graphed.engine.core
    cache = KVCache(core.model.arch, 48, 16, torch.float32, spare_block=True)
    graphs = DecodeGraphs(core.model, cache, max_rows=6, max_blocks=8, flex=True)
    core.runner, core.kv_cache = ModelRunner(core.model, cache, core.device, graphs, "flex"), cache
    assert graphs.batch_sizes[0] == 2 and graphs.block_counts[0] == 2
    prompts = _prompts(core.model.arch.vocab_size)[:4]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert [o.token_ids for o in graphed.generate(prompts, GREEDY)] == want
    assert [graphed.generate([p], GREEDY)[0].token_ids for p in prompts[:2]] == want[:2]
    assert {2, 4} <= {size for size, _ in graphs.graphs}


def test_flex_refuses_an_int8_cache(tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="attention_backend 'flex' reads a float KV cache"):
        LLM(str(tiny_checkpoint_factory("qwen2")), attention_backend="flex", kv_cache_dtype="int8", **ENGINE)


def test_the_flag_reaches_the_config_and_bad_values_are_refused() -> None:
    options = engine_options(parse_args(["serve", "--device", "cuda", "--attention-backend", "flex"]))
    assert EngineConfig.from_options(**options).model.attention_backend == "flex"
    assert EngineConfig.from_options(**engine_options(parse_args(["serve"]))).model.attention_backend == "auto"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--attention-backend", "flash"])
    with pytest.raises(ValueError, match="attention_backend must be one of auto, sdpa, flex"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="runs in one process"):
        ModelConfig(attention_backend="flex", tensor_parallel_size=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("family", ("qwen2", pytest.param("gemma3", marks=pytest.mark.slow)))   # compiles dominate
def test_compiled_flex_with_graphs_gives_the_sdpa_tokens_on_the_gpu(
        family: str, tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    folder = str(tiny_checkpoint_factory(family))
    on_gpu = dict(ENGINE, device="cuda", num_kv_blocks=256)
    sdpa = LLM(folder, attention_backend="sdpa", enforce_eager=True, **on_gpu)
    flex = LLM(folder, attention_backend="flex", **on_gpu)
    prompts = _prompts(flex.engine.core.model.arch.vocab_size)
    want = [o.token_ids for o in sdpa.generate(prompts, GREEDY)]
    assert [o.token_ids for o in flex.generate(prompts, GREEDY)] == want
    assert [flex.generate([p], GREEDY)[0].token_ids for p in prompts] == want
    graphs = flex.engine.runner.graphs
    assert graphs is not None and graphs.failed is None and len(graphs.graphs) >= 2, graphs.failed
