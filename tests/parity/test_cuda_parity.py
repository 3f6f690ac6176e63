"""The engine on a CUDA GPU (these skip on machines without one, CI included).

float32: every family's greedy tokens through the engine on the GPU equal transformers' greedy
`generate` on the same GPU, one request at a time and batched (chunked prefill, mixed steps).
Decode steps replay CUDA graphs unless `enforce_eager`: the same tokens as eager steps.
bfloat16 (what `--device cuda` picks by default): batched equals alone, and seeded sampling gives
the same tokens whichever requests share the batch. n-gram speculation changes no token.
A real GGUF file (`-m real_model --real-gguf FILE`): the same float32 check against transformers'
own GGUF loader, and batched equals alone in bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "mistral", "gemma3")
NUM_TOKENS = 12
PROMPT_LENS = (3, 17, 40, 9)
ENGINE = dict(device="cuda", max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory="32MiB")


def _prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def _transformers_greedy(model: torch.nn.Module, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None   # fixed length, as ignore_eos
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=num_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def _alone_and_batched(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list]:
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    return alone, batched


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_greedy_on_the_gpu_equals_transformers(family: str,
                                                       tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint_factory(family)
    llm = LLM(str(folder), dtype="float32", **ENGINE)
    assert llm.engine.core.device.type == "cuda"
    prompts = _prompts(llm.engine.core.model.arch.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation="eager").to("cuda").eval()
    expected = _transformers_greedy(reference, prompts, NUM_TOKENS)
    alone, batched = _alone_and_batched(llm, prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                     ignore_eos=True))
    assert alone == expected, f"{family}: alone differs from transformers on the GPU"
    assert batched == expected, f"{family}: batched differs from transformers on the GPU"


@pytest.mark.parametrize("family", ("llama", "gemma3"))
def test_decode_graphs_give_the_eager_tokens(family: str, tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    folder = str(tiny_checkpoint_factory(family))
    graphed = LLM(folder, dtype="float32", **ENGINE)
    eager = LLM(folder, dtype="float32", enforce_eager=True, **ENGINE)
    assert eager.engine.runner.graphs is None
    prompts = _prompts(graphed.engine.core.model.arch.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, greedy)]
    assert [o.token_ids for o in graphed.generate(prompts, greedy)] == want
    graphs = graphed.engine.runner.graphs
    assert graphs.failed is None and graphs.graphs, "no decode step was replayed from a CUDA graph"


@pytest.mark.parametrize("family", ("llama", "gemma3"))
def test_bfloat16_batched_equals_alone_and_seeded_sampling_is_batch_invariant(
        family: str, tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_checkpoint_factory(family)), **ENGINE)
    assert llm.engine.core.dtype == torch.bfloat16   # auto on a GPU with bfloat16
    prompts = _prompts(llm.engine.core.model.arch.vocab_size)
    alone, batched = _alone_and_batched(llm, prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                     ignore_eos=True))
    assert batched == alone
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=NUM_TOKENS, ignore_eos=True)
    alone, batched = _alone_and_batched(llm, prompts, sampled)
    assert batched == alone


def test_speculation_on_the_gpu_changes_no_token(tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    folder = str(tiny_checkpoint_factory("llama"))
    plain = LLM(folder, dtype="float32", **ENGINE)
    spec = LLM(folder, dtype="float32", speculative="ngram", num_speculative_tokens=4, ngram_prompt_lookup_min=1,
               **ENGINE)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 9, *_prompts(plain.engine.core.model.arch.vocab_size)[:2]]
    params = [SamplingParams(temperature=0.8, top_k=40, seed=7 + i, max_tokens=NUM_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want
    assert spec.engine.stats.num_accepted_tokens > 0


@pytest.mark.real_model
def test_real_file_on_the_gpu(real_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name,
                                                     dtype=torch.float32).to("cuda").eval()
    llm = LLM(str(real_gguf), dtype="float32", device="cuda", kv_cache_memory="1GiB")
    prompts = _prompts(min(llm.engine.core.model.arch.vocab_size, 32_000), (5, 40, 130, 17))
    expected = _transformers_greedy(reference, prompts, 24)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone, batched = _alone_and_batched(llm, prompts, greedy)
    del llm, reference
    torch.cuda.empty_cache()
    assert alone == expected
    assert batched == expected
    llm = LLM(str(real_gguf), device="cuda", kv_cache_memory="1GiB")
    assert llm.engine.core.dtype == torch.bfloat16
    alone, batched = _alone_and_batched(llm, prompts, greedy)
    assert batched == alone
