"""GGUF blocks kept on the device (model/gguf/gpu_quant.py), run here on CPU tensors: the torch
dequantization equals gguf's `quants.dequantize` bit for bit in every format it takes, on fully random
blocks (every scale bit set somewhere) at odd shapes; the layer and the embedding compute with exactly
those weights; the fused Triton matmul (gpu_matmul.py, where Triton imports: TRITON_INTERPRET=1 on a CPU)
equals the torch path, and it compiles for Hopper (sm_90) in every format wherever Triton is installed."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from conveyor.model.gguf import gpu_matmul
from conveyor.model.gguf.gpu_quant import BLOCKS, GpuQuantEmbedding, GpuQuantLinear, dequantize

# Byte offsets of each format's float16 fields: random bytes there could be NaN or infinite.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def random_raw(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """(n, bytes per row) blocks of random bytes, the float16 scales finite and small."""
    block, size = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scales = rng.uniform(-2e-3, 2e-3, size=(n, k // block)).astype(np.float16)
        raw[:, :, offset: offset + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(type_name: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k))


def shapes(type_name: str) -> list[tuple[int, int]]:
    block = BLOCKS[type_name][0]
    return [(1, block), (7, 3 * block), (33, 2 * block)] + ([(5, 96)] if block == 32 else [(3, 1024)])


@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_dequantize_equals_gguf(type_name: str) -> None:
    for i, (n, k) in enumerate(shapes(type_name)):
        raw = random_raw(type_name, n, k, seed=i)
        got = dequantize(type_name, torch.from_numpy(raw), k, torch.float32)
        assert torch.equal(got, reference(type_name, raw, n, k)), f"{type_name} ({n}, {k})"
        half = dequantize(type_name, torch.from_numpy(raw), k, torch.bfloat16)
        assert torch.equal(half, reference(type_name, raw, n, k).to(torch.bfloat16))


def test_linear_of_segments_and_the_embedding_use_exactly_those_weights() -> None:
    k = 512
    parts = [("Q4_K", random_raw("Q4_K", 40, k, 1)), ("Q6_K", random_raw("Q6_K", 24, k, 2)),
             ("Q8_0", random_raw("Q8_0", 9, k, 3))]
    weight = torch.cat([reference(t, raw, raw.shape[0], k) for t, raw in parts])
    bias = torch.randn(weight.shape[0])
    layer = GpuQuantLinear([(t, torch.from_numpy(raw)) for t, raw in parts], k, bias)
    assert (layer.in_features, layer.out_features) == (k, 73)
    assert sum(b.numel() for b in layer.buffers()) == sum(raw.nbytes for _, raw in parts)
    x = torch.randn(5, k)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert torch.equal(layer(x[2:3]), F.linear(x[2:3], weight, bias))
    table = random_raw("Q8_0", 50, 96, 4)
    embedding = GpuQuantEmbedding("Q8_0", torch.from_numpy(table), 96, torch.float32)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), reference("Q8_0", table, 50, 96)[ids])


def test_a_shape_that_does_not_fit_the_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K rows of 96"):
        GpuQuantLinear([("Q4_K", torch.zeros(4, 54, dtype=torch.uint8))], 96, None)
    with pytest.raises(ValueError, match="take 144 bytes"):
        GpuQuantLinear([("Q4_K", torch.zeros(4, 140, dtype=torch.uint8))], 256, None)


@pytest.mark.skipif(not gpu_matmul.available(), reason="Triton is not installed")
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="no CUDA GPU, and Triton's interpreter is off (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("type_name", list(gpu_matmul.FORMATS))
def test_fused_matmul_equals_the_torch_path(type_name: str) -> None:
    # Triton's interpreter mishandles bfloat16 loads; the kernel's arithmetic is the same in float16.
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float16)
    block = BLOCKS[type_name][0]
    for rows, n, k in [(1, 33, 2 * block), (3, 16, 256 if block == 256 else 96), (8, 40, 512), (70, 20, 256)]:
        raw = torch.from_numpy(random_raw(type_name, n, k, seed=rows)).to(device)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(device, dtype)
        want = (x.float() @ dequantize(type_name, raw, k, dtype).float().t())
        got = gpu_matmul.matmul(type_name, raw, x)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-3 * want.abs().max().item())
    assert gpu_matmul.matmul(type_name, raw, x[:0]).shape == (0, n)


@pytest.mark.skipif(not gpu_matmul.available(), reason="Triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton's interpreter compiles nothing")
def test_the_kernel_compiles_for_hopper_in_every_format() -> None:
    """Built here without a GPU (Triton's own ptxas), so a kernel that would not build fails before a GPU run."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from conveyor.model.gguf import triton_matmul

    signature = {"w_ptr": "*u8", "x_ptr": "*bf16", "y_ptr": "*bf16", **dict.fromkeys(
        ("T", "N", "K", "row_bytes", "chunk_bytes", "num_chunks"), "i32"),
        **dict.fromkeys(("FMT", "SIZE", "BLOCK_N", "ROWS"), "constexpr")}
    for code, (type_name, (_, size)) in enumerate(gpu_matmul.FORMATS.items()):
        for rows in (16, 64) if type_name == "Q4_K" else (16,):
            source = ASTSource(fn=triton_matmul.matmul, signature=signature,
                               constexprs={"FMT": code, "SIZE": size, "BLOCK_N": 16, "ROWS": rows})
            assert "cubin" in triton_compile(source, target=GPUTarget("cuda", 90, 32)).asm, type_name
