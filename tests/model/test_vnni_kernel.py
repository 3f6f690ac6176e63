"""On a CPU with VNNI, the VNNI builds of the quantized matmul give the same bits as the AVX2-only
build of the same sources, for every format, at odd shapes and at the extremes of codes, scales and
activations: the integer block dots are exact on both paths and the float steps are the same, so
any difference is a bug, not rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.kernels import quant
from conveyor.kernels.build import AVX2

from gguf_blocks import random_blocks

NATIVE = kernels.cpu_features()
# The VNNI builds this CPU can run: its own, and the 256-bit-only one an AVX-512 part can stand in for.
VNNI_BUILDS = {}
if AVX2 <= NATIVE and ("avx_vnni" in NATIVE or {"avx512f", "avx512vl", "avx512_vnni"} <= NATIVE):
    VNNI_BUILDS["native"] = NATIVE
    if {"avx512f", "avx512vl", "avx512_vnni"} <= NATIVE:
        VNNI_BUILDS["vnni256"] = AVX2 | {"avx512f", "avx512vl", "avx512_vnni"}
    if "avx_vnni" in NATIVE:
        VNNI_BUILDS["avx_vnni"] = AVX2 | {"avx_vnni"}

pytestmark = [
    pytest.mark.skipif(kernels.library() is None, reason="no C compiler"),
    pytest.mark.skipif(not VNNI_BUILDS, reason="this CPU has no VNNI (AVX-VNNI or AVX512-VNNI with VL): "
                                               "nothing to compare the AVX2 build with"),
]
FORMATS = ["q5_0", "q5_1", "iq4_nl", "q4_k", "q5_k", "q6_k", "iq4_xs", "q3_k", "q8_0", "q4_0", "q4_1"]
ROWS = [1, 2, 3, 5, 6, 7, 8, 9, 17, 64, 65]


def _library(features: frozenset[str]) -> kernels.KernelLibrary:
    library = kernels.library_for(frozenset(features))
    assert library is not None
    return library


def _extreme_blocks(fmt: str, n: int, k: int) -> np.ndarray:
    """Blocks of the largest codes and scales the format holds: the int16 / int32 sums at their limits."""
    raw = random_blocks(fmt, n, k, seed=5)
    if fmt in ("q4_k", "q5_k", "q6_k"):
        blocks = raw.reshape(n, k // 256, -1)
        if fmt == "q6_k":
            blocks[:, :, :192] = 0xff                                     # code 63 everywhere
            blocks[:, :, 192:208] = np.array([-128, 127] * 8, np.int8).view(np.uint8)
        else:
            blocks[:, :, 4:16] = 0xff                                     # 6-bit scales and mins at 63
            blocks[:, :, 16:] = 0xff                                      # code 15 / 31 everywhere
    return raw


def _run(library: kernels.KernelLibrary, fmt: str, raw: np.ndarray, n: int, k: int, x: torch.Tensor,
         bias: torch.Tensor) -> torch.Tensor:
    return quant.gemm(library, x, quant.repack(library, fmt, raw, n, k), bias, num_threads=2)


def test_the_vnni_builds_run_a_vnni_path() -> None:
    for name, features in VNNI_BUILDS.items():
        library = _library(features)
        assert quant.isa(library).endswith("vnni"), name
    assert quant.isa(_library(AVX2)) == "avx2"


@pytest.mark.parametrize("build", list(VNNI_BUILDS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(33, 256), (100, 768)])
def test_vnni_equals_avx2_bit_for_bit(build: str, fmt: str, n: int, k: int) -> None:
    kk = k - 32 * 3 if fmt in ("q5_0", "q8_0", "q4_0", "q4_1") else k   # K not a multiple of 256 where allowed
    raw = random_blocks(fmt, n, kk, seed=n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(max(ROWS), kk, generator=gen) * 3
    x[:, 64:96] = 0                                                      # a zero block
    bias = torch.randn(n, generator=gen)
    vnni, avx2 = _library(VNNI_BUILDS[build]), _library(AVX2)
    for m in ROWS:
        y = _run(vnni, fmt, raw, n, kk, x[:m], bias)
        assert torch.equal(y, _run(avx2, fmt, raw, n, kk, x[:m], bias)), (fmt, m)


@pytest.mark.parametrize("build", list(VNNI_BUILDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_vnni_equals_avx2_at_the_extremes(build: str, fmt: str) -> None:
    n, k = 35, 512
    raw = _extreme_blocks(fmt, n, k)
    x = torch.full((8, k), 2.0)
    x[1] = -2.0                                                          # every code times -127
    x[2, ::2] = -2.0
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(0))
    x[4, :32] = 0
    vnni, avx2 = _library(VNNI_BUILDS[build]), _library(AVX2)
    for m in (1, 2, 5, 8):
        assert torch.equal(_run(vnni, fmt, raw, n, k, x[:m], None), _run(avx2, fmt, raw, n, k, x[:m], None)), (fmt, m)


@pytest.mark.parametrize("build", list(VNNI_BUILDS))
def test_vnni_equals_avx2_in_a_mixed_linear(build: str) -> None:
    k, parts = 512, [("q5_0", 64), ("q6_k", 40), ("q8_0", 33), ("q4_k", 32)]
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(sum(n for _, n in parts), generator=torch.Generator().manual_seed(4))
    outputs = []
    for library in (_library(VNNI_BUILDS[build]), _library(AVX2)):
        weights = [quant.repack(library, fmt, random_blocks(fmt, n, k, seed=i), n, k) for i, (fmt, n) in enumerate(parts)]
        outputs.append(quant.run_linear(library, x, quant.linear_spec(weights, bias), bias.shape[0]))
    assert torch.equal(*outputs)
