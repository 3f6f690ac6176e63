"""The kernel builds a test runs each code path with: native, AVX2 and portable, as far as this CPU runs them."""

from __future__ import annotations

import pytest

from conveyor import kernels
from conveyor.kernels.build import AVX2, builds

NATIVE = kernels.cpu_features()
VARIANTS = builds(NATIVE, ("native", "avx2", "portable"))


def library(variant: str) -> kernels.KernelLibrary:
    """The build for one of VARIANTS (skips the test where this CPU has no AVX2)."""
    if variant == "avx2" and not AVX2 <= NATIVE:
        pytest.skip("this CPU has no AVX2")
    built = kernels.library_for(frozenset(VARIANTS[variant]))
    assert built is not None
    return built
