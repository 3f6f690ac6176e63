"""The CUDA-graph decode path's own logic, run eagerly on the CPU (off a GPU `DecodeGraphs` replays
its static inputs without recording a graph): buckets of rows and key blocks, padding rows in the
spare block, in-graph masks (sliding windows too) and the rows to sample. Tokens must equal the
plain torch path's, alone and batched, across bucket boundaries; tests/parity/test_cuda_parity.py
runs the recorded graphs on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams, kernels
from conveyor.runtime.cuda_graphs import DecodeGraphs
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.model_runner import ModelRunner

NUM_TOKENS = 20
PROMPT_LENS = (3, 17, 40, 9, 33, 5)   # contexts cross 1, 2, 4 blocks of 16 while decoding


@pytest.fixture(autouse=True)
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The graphs run torch's attention over an untransposed cache, as on a GPU.
    monkeypatch.setattr(kernels, "library", lambda: None)


def _engine(folder: Path, graphs: bool) -> LLM:
    llm = LLM(str(folder), dtype="float32", max_num_seqs=6, max_num_batched_tokens=32, kv_cache_memory="16MiB",
              block_size=16)
    if graphs:
        core = llm.engine.core
        plain = core.kv_cache
        cache = KVCache(core.model.arch, plain.num_blocks, plain.block_size, plain.tensor.dtype, spare_block=True)
        runner = ModelRunner(core.model, cache, core.device, DecodeGraphs(core.model, cache, max_rows=6, max_blocks=8))
        core.runner, core.kv_cache = runner, cache
    return llm


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("family", ("llama", "mistral", "gemma3"))   # plain, a window on every layer, mixed windows
def test_graph_inputs_give_the_plain_paths_tokens(family: str, tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint_factory(family)
    plain, graphed = _engine(folder, graphs=False), _engine(folder, graphs=True)
    prompts = _prompts(plain.engine.core.model.arch.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    graphs = graphed.engine.core.runner.graphs
    assert [o.token_ids for o in graphed.generate(prompts, greedy)] == want
    assert [graphed.generate([p], greedy)[0].token_ids for p in prompts] == want
    sizes = {size for size, _ in graphs.graphs}
    assert {1, 6} <= sizes and len({blocks for _, blocks in graphs.graphs}) >= 3, graphs.graphs.keys()
    # Seeded sampling rides the same logits.
    sampled = [SamplingParams(temperature=0.9, seed=i, max_tokens=NUM_TOKENS, ignore_eos=True) for i in range(6)]
    assert [o.token_ids for o in graphed.generate(prompts, sampled)] == \
        [o.token_ids for o in plain.generate(prompts, sampled)]


def test_padding_rows_touch_only_the_spare_block(tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    llm = _engine(tiny_checkpoint_factory("llama"), graphs=True)
    cache = llm.engine.core.kv_cache
    # 3 rows in a 4-row graph: one padding row each decode step.
    llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    spare = cache.spare_block
    used = cache.tensor[:, :, :spare].abs().sum(dim=(0, 1, 3, 4, 5)).nonzero().flatten().tolist()
    assert spare == cache.num_blocks and cache.tensor[:, :, spare].abs().sum() > 0
    assert len(used) <= 3   # the requests' own blocks (shared prefix or not), nothing else
