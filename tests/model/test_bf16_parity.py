"""bfloat16 forward (torch ops and C kernels) against transformers, measured against float32 truth.

Two bfloat16 implementations never agree bit for bit: they round at different points. What must hold
is that ours is as close to the float32 result as transformers' own bfloat16 forward is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor import kernels
from conveyor.model.loader import load_model
from test_hf_parity import PATHS, PagedRunner, hf_logits, one_thread, random_tokens  # noqa: F401

PROMPT_LENS = (6, 19, 1)
NUM_DECODE_STEPS = 3
SLACK = 2.0    # ours may be this many times further from float32 than transformers' bfloat16 is


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3", "gemma3"])
def test_bf16_is_as_close_to_float32_as_transformers_bf16(
        name: str, path: str, tiny_checkpoint_factory: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint_factory(name)
    ours = load_model(folder, torch.bfloat16, kernel_library=kernels.library() if path == "kernels" else None)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager").eval()

    runner = PagedRunner(ours, seed=5)
    prompts = random_tokens(ours.arch.vocab_size, PROMPT_LENS, seed=41)
    continuations = random_tokens(ours.arch.vocab_size, (NUM_DECODE_STEPS,) * len(prompts), seed=42)
    tables = [runner.allocate(len(p) + NUM_DECODE_STEPS) for p in prompts]
    got: list[torch.Tensor] = list(runner.step([(p, 0, t) for p, t in zip(prompts, tables)]))
    sequences = [list(p) for p in prompts]
    for step in range(NUM_DECODE_STEPS):
        decode = runner.step([([c[step]], len(seq), t) for seq, c, t in zip(sequences, continuations, tables)])
        for i, (seq, c) in enumerate(zip(sequences, continuations)):
            seq.append(c[step])
            got[i] = torch.cat([got[i], decode[i]])

    for i, seq in enumerate(sequences):
        truth, theirs = hf_logits(hf32, seq), hf_logits(hf16, seq)
        ours_err = (got[i] - truth).abs().max().item()
        their_err = (theirs - truth).abs().max().item()
        floor = 1e-3 * truth.abs().max().item()
        assert their_err > 0, "transformers' bfloat16 equals float32: the comparison would be vacuous"
        assert ours_err <= SLACK * their_err + floor, (
            f"{name}/{path} row {i}: ours is {ours_err:.3g} from float32, transformers bf16 {their_err:.3g}")
