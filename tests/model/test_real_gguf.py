"""The real-file tier: a GGUF file a user downloaded, given with `pytest -m real_model --real-gguf FILE`.

CI has no such file (model hubs are out of reach, and the PyPI packages that carry some come in
hundreds of MB of parts), so these skip there; run them on any Q4_K_M-style file you have.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams
from conveyor.model.quant import QuantLinear

pytestmark = pytest.mark.real_model

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Three prime numbers are"]


def test_real_file_runs_in_its_own_formats_and_batched_equals_alone(real_gguf: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor"):
        llm = LLM(str(real_gguf), kv_cache_memory="256MiB")
    assert "weights kept in the file's formats" in caplog.text
    assert any(isinstance(m, QuantLinear) for m in llm.engine.core.model.modules())
    params = SamplingParams(temperature=0, max_tokens=16)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert all(o.token_ids for o in batched)


def test_real_file_prompt_logprobs_match_transformers(real_gguf: Path) -> None:
    """Prompt scores (echo / prompt_logprobs) of the file's weights dequantized to float32 against
    transformers' forward of the same file, also dequantized: the scoring path, not the formats."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(str(real_gguf), quantization="none", dtype="float32", kv_cache_memory="256MiB",
              max_num_batched_tokens=32)
    prompt = llm.tokenizer.encode(" ".join(PROMPTS) + " and then some more words to pass a chunk or two.")
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    model = AutoModelForCausalLM.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)
    expected = reference.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    got = torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])
    assert out.prompt_logprobs[0] is None and len(got) == len(expected)
    assert torch.allclose(got, expected, atol=2e-3), (got - expected).abs().max()
