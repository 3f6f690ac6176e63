"""The K-quant and Q5_0 kernels equal a float64 product of gguf's own dequantization of the file's
blocks with the kernel's int8 activations, on every code path this CPU can run, at odd shapes; each
row's result is the same bits whatever the batch; mixed formats in one linear equal each alone."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.kernels import quant
from conveyor.kernels.build import builds

from gguf_blocks import TYPES, random_blocks

NATIVE = kernels.cpu_features()
VARIANTS = builds(NATIVE)   # native, and each narrower code path this CPU also runs
pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")
def _library(variant: str) -> kernels.KernelLibrary:
    library = kernels.library_for(frozenset(VARIANTS[variant]))
    assert library is not None
    return library


def _reference(library, x: torch.Tensor, raw: np.ndarray, fmt: str, bias: torch.Tensor) -> torch.Tensor:
    w = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, TYPES[fmt]), dtype=np.float64))
    return quant.activations(library, x, fmt).double() @ w.t() + bias.double()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "iq4_nl", "q4_k", "q5_k", "q6_k", "iq4_xs", "q3_k"])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (2, 33, 512), (7, 100, 256), (64, 64, 768), (3, 1, 256),
                                   (5, 40, 768), (8, 65, 1280)])   # 5..8 rows: one pass, spans of 512 k and a part
def test_kquant_gemm_matches_gguf_dequantization(variant: str, fmt: str, m: int, n: int, k: int) -> None:
    library = _library(variant)
    kk = k if fmt not in ("q5_0", "q5_1", "iq4_nl") else k - 32 * (m % 3)   # 32-k formats at other K too
    raw = random_blocks(fmt, n, kk, seed=m * 1000 + n)
    w = quant.repack(library, fmt, raw, n, kk)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, kk, generator=gen)
    bias = torch.randn(n, generator=gen)
    y = quant.gemm(library, x, w, bias)
    expected = _reference(library, x, raw, fmt, bias)
    scale = expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * scale)
    for row in range(m):
        assert torch.equal(quant.gemm(library, x[row:row + 1], w, bias)[0], y[row])
    assert torch.equal(quant.gemm(library, x.flip(0), w, bias, num_threads=1).flip(0), y)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_formats_in_one_linear_equal_each_alone(variant: str) -> None:
    library = _library(variant)
    k, parts = 512, [("q5_0", 64), ("q6_k", 40), ("q8_0", 33), ("iq4_xs", 32)]
    weights = [quant.repack(library, fmt, random_blocks(fmt, n, k, seed=i), n, k) for i, (fmt, n) in enumerate(parts)]
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(sum(n for _, n in parts), generator=torch.Generator().manual_seed(4))
    y = quant.run_linear(library, x, quant.linear_spec(weights, bias), bias.shape[0])
    alone, start = [], 0
    for w in weights:
        alone.append(quant.gemm(library, x, w, bias[start:start + w.n]))
        start += w.n
    assert torch.equal(y, torch.cat(alone, dim=1))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0", "q8_0", "q3_k", "iq4_nl"])
def test_repack_takes_a_row_order(fmt: str) -> None:
    library = _library("native")
    n, k = 70, 256
    raw = random_blocks(fmt, n, k, seed=7)
    order = np.random.default_rng(0).permutation(n)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    permuted = quant.gemm(library, x, quant.repack(library, fmt, raw, n, k, rows=order))
    plain = quant.gemm(library, x, quant.repack(library, fmt, raw, n, k))
    assert torch.equal(permuted, plain[:, torch.from_numpy(order)])


def test_refuses_k_the_format_cannot_take() -> None:
    library = _library("native")
    assert not quant.can_keep("q4_k", 896) and quant.can_keep("q5_0", 896) and quant.can_keep("q6_k", 4864 // 19 * 19)
    with pytest.raises(ValueError, match="divisible by 256"):
        quant.repack(library, "q4_k", np.zeros((4, 100), np.uint8), 4, 320)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_c_repack_of_the_legacy_formats_equals_the_numpy_one(fmt: str) -> None:
    library = _library("native")
    raw = random_blocks(fmt, 45, 96, seed=2)
    assert torch.equal(quant.repack(library, fmt, raw, 45, 96).data, quant.from_gguf_blocks(fmt, raw, 45, 96).data)


def test_activation_quantization_is_the_same_on_every_path() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 544, generator=gen) * 3
    x[1, :64] = 0                                      # all-zero blocks
    x[2, 96:128] = 126.5 / 127 * 2                     # a block of exact ties, rounded to even
    x[2, 96] = 2.0
    x[3, 7] = 1e30
    native = quant.activations(_library("native"), x)
    assert torch.equal(native, quant.activations(_library("portable"), x))
    assert torch.equal(native[2, 97:128], torch.full((31,), 126.0) * (torch.tensor(2.0) / 127))
