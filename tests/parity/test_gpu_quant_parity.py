"""The GPU's kept-quantized path (GGUF blocks on the device in torch's layers, model/gguf/gpu_quant.py)
run on the CPU (`quantized_layers="torch"`) with the bundled Q4_1 file, float32 activations: its greedy
tokens equal the dequantized weights' (`quantization="none"`), batched equals alone (chunked prefill
too), and every linear layer, the tied output layer and the embedding hold the file's blocks; with
bfloat16 activations it answers as the model does."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.gguf.gpu_quant import GpuQuantEmbedding, GpuQuantLinear

from test_batched_parity import assert_same_tokens, make_prompts

pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4)


def test_blocks_on_the_device_give_the_dequantized_weights_tokens() -> None:
    prompts = make_prompts(3, seed=2)
    kept = LLM(quantization="gguf", quantized_layers="torch", max_num_batched_tokens=4096, **ENGINE)
    model = kept.engine.core.model
    linears = [m for m in model.modules() if isinstance(m, GpuQuantLinear)]
    assert len(linears) == 4 * model.arch.num_layers + 1 and model.lm_head in linears
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.embed_tokens, GpuQuantEmbedding)
    assert model.lm_head.qdata0 is model.embed_tokens.qdata   # tied: one copy of the table's blocks
    # The blocks are what the model holds: Q4_1 is 5 bits a weight, the Q8_0 table 8.5 (float32: 32).
    assert sum(b.nbytes for b in model.buffers()) < model.arch.num_parameters * 0.75
    assert "q4_1 x210" in kept.engine.core.info.weights
    dequantized = LLM(quantization="none", max_num_batched_tokens=4096, **ENGINE)
    want = [dequantized.generate([p], GREEDY)[0] for p in prompts]
    alone = [kept.generate([p], GREEDY)[0] for p in prompts]
    assert_same_tokens(alone, want, "kept blocks vs dequantized weights")
    assert_same_tokens(kept.generate(prompts, GREEDY), alone, "kept blocks batched")
    chunked = LLM(quantization="gguf", quantized_layers="torch", max_num_batched_tokens=32, **ENGINE)
    assert_same_tokens(chunked.generate(prompts, GREEDY), alone, "kept blocks chunked")


def test_the_torch_layers_take_bfloat16_activations() -> None:
    # On the CPU torch's bfloat16 matmul sums a row in an order that depends on the batch's rows, so
    # this checks the answer, not batch invariance (which the GPU test checks on the Triton kernel).
    llm = LLM(quantization="gguf", quantized_layers="torch", dtype="bfloat16", kv_cache_memory="64MiB")
    assert llm.engine.core.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=8)
    answer = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]], params)[0]
    assert answer.text == "The capital of France is Paris."


def test_quantized_layers_is_checked() -> None:
    with pytest.raises(ValueError, match="quantized_layers must be one of auto, torch"):
        LLM(quantized_layers="triton")
