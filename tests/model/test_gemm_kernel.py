"""The packed C matmul equals torch's, on every code path this CPU can run, and is batch invariant."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from conveyor import kernels
from conveyor.kernels import gemm
from conveyor.kernels.build import build, builds

NATIVE = kernels.cpu_features()
# Each narrower feature set this CPU also supports builds its own library, so AVX2 and portable
# code paths are tested on an AVX-512 machine too.
VARIANTS = builds(NATIVE, ("native", "avx2", "portable"))
pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")


def _library(variant: str) -> kernels.KernelLibrary:
    if variant == "avx2" and not {"avx2", "fma"} <= NATIVE:
        pytest.skip("this CPU has no AVX2")
    library = kernels.library_for(frozenset(VARIANTS[variant]))
    assert library is not None
    return library


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (3, 100, 64), (13, 200, 96), (70, 64, 1536), (9, 33, 10)])
def test_gemm_matches_torch_and_is_batch_invariant(variant: str, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("bf16 packing pairs K")
    library = _library(variant)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = gemm.pack(w)
    assert torch.equal(gemm.unpack(packed, n), w)
    y = gemm.gemm(library, x, packed, n, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    expected = F.linear(x.double(), w.double(), bias.double())
    # float32: summation order only; bf16: the output's own rounding (8 bits of mantissa).
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * k ** 0.5)
    # Every row alone gives bit for bit what it gave inside the batch.
    for row in range(m):
        assert torch.equal(gemm.gemm(library, x[row:row + 1], packed, n, bias)[0], y[row])
    # The residual epilogue equals a separate add of the (rounded) product, in place.
    residual = torch.randn(m, n, generator=gen).to(dtype)
    summed = gemm.gemm(library, x, packed, n, bias, residual=residual.clone())
    assert torch.equal(summed, y + residual)


def test_gemm_without_bias_and_strided_input() -> None:
    library = _library("native")
    w = torch.randn(64, 32)
    x = torch.randn(5, 64)[:, :32]           # rows with a stride longer than K
    torch.testing.assert_close(gemm.gemm(library, x, gemm.pack(w), 64), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_build_is_cached_per_feature_set() -> None:
    native, portable = _library("native"), _library("portable")
    if native.features != portable.features:
        assert native.path != portable.path
    again = build(native.features)
    assert again is not None and again.path == native.path
