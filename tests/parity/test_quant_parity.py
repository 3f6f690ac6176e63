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


# The float prefill attention pads each group to its longest row, which changes a row's float
# results in the last bits (seen: float32 logprobs batched vs alone differ by 3e-6 on the bundled
# model); per-block int8 activation rounding can amplify such a bit into a different token.
# The quantized layers themselves are bitwise batch invariant (tests/model/test_quant_model.py).
NOT_BITWISE = pytest.mark.xfail(reason="float prefill attention is not bitwise batch invariant", strict=False)


@pytest.mark.parametrize("quantization", ["gguf", pytest.param("int8", marks=NOT_BITWISE)])
def test_batched_equals_alone_with_quantized_weights(quantization: str) -> None:
    prompts = make_prompts(8, seed=1)
    llm = LLM(quantization=quantization, max_num_seqs=8, max_num_batched_tokens=4096, kv_cache_memory="256MiB")
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert_same_tokens(llm.generate(prompts, GREEDY), alone, f"{quantization} roomy")
    chunked = LLM(quantization=quantization, max_num_seqs=8, max_num_batched_tokens=48, kv_cache_memory="256MiB")
    assert_same_tokens(chunked.generate(prompts, GREEDY), alone, f"{quantization} chunked")
