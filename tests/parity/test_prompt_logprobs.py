"""Prompt logprobs (echo with logprobs, vLLM's prompt_logprobs) against transformers' float32 forward.

Each prompt token's score is log_softmax of the logits at the position before it; the engine computes
them with the prompt's chunks, so this runs prompts longer than a chunk, batched with plain requests,
after a run that left the prompt's blocks in the prefix cache, and checks that the generated tokens of
every request are those it gets alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams

PROMPT_LENS = (1, 5, 23, 40)   # one token (only its null), under a block, over a chunk of 16
TOL = 1e-4


def _reference(folder: Path, prompt: list[int]) -> torch.Tensor:
    """(L - 1, V) float32: log_softmax of transformers' logits at positions 0..L-2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), dtype="float32", threads=2, max_num_seqs=4, max_num_batched_tokens=16,
               kv_cache_memory="32MiB")


def _prompts(llm: LLM) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    vocab_size = llm.engine.core.model.arch.vocab_size
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def test_prompt_logprobs_match_transformers_alone_batched_and_cached(llm: LLM, tiny_checkpoint: Path) -> None:
    prompts = _prompts(llm)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate([p], scored, use_tqdm=False)[0] for p in prompts]
    # Batched with plain requests of the same prompts, whose blocks the first run left in the prefix cache.
    mixed = llm.generate(prompts + prompts, [scored] * len(prompts) + [plain] * len(prompts), use_tqdm=False)
    for prompt, one, batched, other in zip(prompts, alone, mixed, mixed[len(prompts):]):
        assert one.token_ids == batched.token_ids == other.token_ids
        assert other.prompt_logprobs is None
        for got in (one.prompt_logprobs, batched.prompt_logprobs):
            assert got is not None and len(got) == len(prompt) and got[0] is None
            if len(prompt) == 1:
                continue
            reference = _reference(tiny_checkpoint, prompt)
            expected = reference.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor([e.logprob for e in got[1:]]), expected, atol=TOL)
            ranks = (reference > expected.unsqueeze(1)).sum(dim=-1) + 1
            assert [e.rank for e in got[1:]] == ranks.tolist()
            top_values, top_ids = reference.topk(3, dim=-1)
            assert [[i for i, _ in e.top] for e in got[1:]] == top_ids.tolist()
            assert torch.allclose(torch.tensor([[v for _, v in e.top] for e in got[1:]]), top_values, atol=TOL)


def test_preempted_prompt_is_scored_once(tiny_checkpoint: Path) -> None:
    """A KV cache too small for all at once preempts and recomputes; the scores still come once per token."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", threads=2, max_num_seqs=4, max_num_batched_tokens=16,
              num_kv_blocks=8, block_size=8, enable_prefix_caching=False)
    prompts = _prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=0)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for one, other in zip(alone, batched):
        assert one.token_ids == other.token_ids
        assert len(one.prompt_logprobs) == len(other.prompt_logprobs) == len(one.prompt_token_ids)
        for a, b in zip(one.prompt_logprobs[1:], other.prompt_logprobs[1:]):
            assert abs(a.logprob - b.logprob) < TOL and a.rank == b.rank and a.top == b.top == []
