"""Every family, end to end through the engine: greedy tokens equal transformers' greedy `generate`,
one request at a time and batched (with chunked prefill), on the tiny random-weight checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "mistral", "gemma3")
NUM_TOKENS = 12
PROMPT_LENS = (3, 17, 40, 9)   # Gemma's window is 8 and Mistral's 8: prompts and outputs run past them


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def _transformers_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None   # fixed length, as ignore_eos (min_new_tokens would mask EOS)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_batched_and_alone(family: str,
                                                            tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint_factory(family)
    # float32 so both sides compute the same numbers; 16-token chunks split the longer prompts.
    llm = LLM(str(folder), dtype="float32", threads=2, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory="32MiB")
    prompts = _prompts(llm.engine.core.model.arch.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = _transformers_greedy(folder, prompts)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert alone == expected, f"{family}: alone differs from transformers"
    assert batched == expected, f"{family}: batched differs from transformers"
