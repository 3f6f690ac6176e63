"""A GGUF file kept in its own formats on a CUDA GPU (these skip without one, CI included).

On the bundled Q4_1 file and on each `--real-gguf FILE` (a Q4_K_M file: the K-quants; see
scripts/make_kquant_test_model.py for a small one): every linear layer, the token table and the tied
output layer hold the file's blocks (GpuQuantLinear), and the model holds those bytes, not bfloat16;
float32 activations (the torch dequantization) give the greedy tokens of the CPU's float32 run of the
dequantized weights on most prompts; bfloat16 (the Triton kernel where it is installed) those of the
GPU's bfloat16 run of the weights dequantized at load, up to near-ties (random-weight files have many,
and the two sum in different orders: where they part, the reference's top two logits are within
NEAR_TIE and ours is one of them); batched equals alone; decode steps replay CUDA graphs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.gguf import gpu_matmul
from conveyor.model.gguf.gpu_quant import GpuQuantEmbedding, GpuQuantLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
pytest.importorskip("gguf")

PROMPT_LENS = (5, 40, 130, 17)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NEAR_TIE = 0.5   # logits: bfloat16 over a model's layers moves a logit of 20 by a tenth or two
ENGINE = dict(device="cuda", kv_cache_memory="1GiB", max_num_seqs=8)


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, min(vocab_size, 32_000), (n,), generator=generator).tolist() for n in PROMPT_LENS]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _most(got: list[list[int]], want: list[list[int]]) -> bool:
    return sum(g == w for g, w in zip(got, want)) >= len(want) - 1


def _part_at_near_ties(got: list[list[int]], reference: list) -> None:
    for i, (tokens, want) in enumerate(zip(got, reference)):
        step = next((j for j, (a, b) in enumerate(zip(tokens, want.token_ids)) if a != b), None)
        if step is None:
            continue
        top = want.logprobs[step].top
        gap = top[0][1] - top[1][1]
        assert tokens[step] in (top[0][0], top[1][0]) and gap < NEAR_TIE, \
            f"prompt {i} parts at step {step}: {tokens[step]} vs {want.token_ids[step]}, top-2 gap {gap:.3f}"


def _free(llm: LLM) -> None:
    del llm
    torch.cuda.empty_cache()


def _check(path: str | None) -> None:
    cpu = LLM(path, dtype="float32", quantization="none", kv_cache_memory="256MiB")
    prompts = _prompts(cpu.engine.core.model.arch.vocab_size)
    reference = _tokens(cpu, prompts)
    _free(cpu)

    kept32 = LLM(path, dtype="float32", **ENGINE)
    model = kept32.engine.core.model
    linears = [m for m in model.modules() if isinstance(m, GpuQuantLinear)]
    assert len(linears) >= 4 * model.arch.num_layers, "a layer of the file's formats was dequantized"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(b.device.type == ENGINE["device"] for b in model.buffers())
    weight_bytes = sum(b.nbytes for b in model.buffers()) + sum(p.nbytes for p in model.parameters())
    assert weight_bytes < model.arch.num_parameters, "the model holds more than a byte a weight"
    got32 = _tokens(kept32, prompts)
    _free(kept32)
    assert _most(got32, reference), f"float32 on the GPU {got32} vs the CPU {reference}"

    dequantized = LLM(path, quantization="none", **ENGINE)
    reference16 = dequantized.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                               logprobs=2))
    _free(dequantized)
    kept = LLM(path, **ENGINE)
    assert kept.engine.core.dtype == torch.bfloat16
    assert isinstance(kept.engine.core.model.embed_tokens, GpuQuantEmbedding)
    alone = [kept.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert _tokens(kept, prompts) == alone
    _part_at_near_ties(alone, reference16)
    graphs = kept.engine.runner.graphs
    assert graphs.failed is None and graphs.graphs, "no decode step was replayed from a CUDA graph"
    _free(kept)


def test_the_bundled_file_kept_quantized_on_the_gpu() -> None:
    if importlib.util.find_spec("triton") is not None:
        assert gpu_matmul.available()
    _check(None)


@pytest.mark.real_model
def test_real_files_kept_quantized_on_the_gpu(request: pytest.FixtureRequest) -> None:
    files = request.config.getoption("--real-gguf")
    if not files:
        pytest.skip("no --real-gguf=FILE given (e.g. the file scripts/make_kquant_test_model.py writes)")
    for path in files:
        assert Path(path).is_file(), path
        _check(path)
