"""The quantized-weight matmul equals a float64 product of its dequantized weights and activations,
on every code path this CPU can run, and is batch invariant bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.kernels import quant
from conveyor.kernels.build import builds, quant_isa

from kernel_builds import NATIVE, VARIANTS
from kernel_builds import library as _library

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")


def _weight(fmt: str, n: int, k: int, seed: int) -> quant.QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[:, :32] *= 10                                   # an outlier block
    if fmt == "int8":
        return quant.quantize_int8(w)
    import gguf
    kind = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
            "q4_1": gguf.GGMLQuantizationType.Q4_1}[fmt]
    return quant.from_gguf_blocks(fmt, gguf.quants.quantize(w.numpy(), kind), n, k)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (3, 100, 64), (13, 200, 96), (70, 64, 1536), (6, 33, 32)])
def test_quant_gemm_matches_reference_and_is_batch_invariant(variant: str, fmt: str, m: int, n: int, k: int) -> None:
    library = _library(variant)
    w = _weight(fmt, n, k, seed=m * 1000 + n)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    y = quant.gemm(library, x, w, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    expected = quant.activations(library, x).double() @ quant.dequantize(w).double().t() + bias.double()
    # Integer block dots are exact; only the float accumulation over K/32 blocks rounds.
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4 * k ** 0.5)
    for row in range(m):
        assert torch.equal(quant.gemm(library, x[row:row + 1], w, bias)[0], y[row])
    # Reversed batch order and one thread: still the same bits per row.
    assert torch.equal(quant.gemm(library, x.flip(0), w, bias, num_threads=1).flip(0), y)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_repack_is_lossless(fmt: str) -> None:
    import gguf
    kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
    w = np.random.default_rng(0).standard_normal((70, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, kind)
    packed = quant.from_gguf_blocks(fmt, raw, 70, 96)
    assert torch.equal(quant.dequantize(packed), torch.from_numpy(gguf.quants.dequantize(raw, kind)))
    both = quant.concat_rows([packed, quant.from_gguf_blocks(fmt, raw[:5], 5, 96)])
    assert torch.equal(quant.dequantize(both)[70:], quant.dequantize(packed)[:5])


def test_int8_is_close_to_float() -> None:
    w = torch.randn(64, 128)
    err = (quant.dequantize(quant.quantize_int8(w)) - w).abs().max()
    assert err <= w.abs().max() / 127


def test_each_build_runs_the_code_path_its_features_select() -> None:
    for name, features in builds(NATIVE).items():
        assert quant.isa(kernels.library_for(features)) == quant_isa(features), name
    assert quant.isa(_library("portable")) == "portable"
