"""Batched greedy output equals one-request-at-a-time output with weights kept quantized (the bundled
Q4_1 file served as Q4_1 with its Q8_0 output layer, and int8), plain and chunked prefill."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor import kernels

from test_batched_parity import assert_same_tokens, make_prompts

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


# Every part of the step is bitwise batch invariant (quantized matmuls, the attention kernel for every
# query), so per-block int8 activation rounding has no stray last bit to amplify into another token.
@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_batched_equals_alone_with_quantized_weights(quantization: str) -> None:
    prompts = make_prompts(8, seed=1)
    llm = LLM(quantization=quantization, max_num_seqs=8, max_num_batched_tokens=4096, kv_cache_memory="256MiB")
    # The live view and /props name the weights as they run, not the activations' dtype.
    weights = llm.engine.core.info.weights
    assert "q4_1 x210" in weights.lower() if quantization == "gguf" else weights == "int8"
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert_same_tokens(llm.generate(prompts, GREEDY), alone, f"{quantization} roomy")
    chunked = LLM(quantization=quantization, max_num_seqs=8, max_num_batched_tokens=48, kv_cache_memory="256MiB")
    assert_same_tokens(chunked.generate(prompts, GREEDY), alone, f"{quantization} chunked")
