"""The elementwise C kernels equal torch's ops."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch.nn import functional as F

from conveyor import kernels

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")
NATIVE = kernels.cpu_features()
VARIANTS = {"native": NATIVE, "portable": frozenset()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation_matches_torch(variant: str, dtype: torch.dtype, act: str) -> None:
    library = kernels.library_for(frozenset(VARIANTS[variant]))
    assert library is not None
    fn = library.lib.gated_act
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    code = {"silu": 0, "gelu_tanh": 1}[act]
    m, inter = 7, 300
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(m, 2 * inter, generator=gen) * 4)
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -88.5])   # saturation and tiny inputs
    x = x.to(dtype)
    y = torch.empty(m, inter, dtype=dtype)
    fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), m, inter, code, dtype == torch.bfloat16, 2)
    gate, up = x.float().chunk(2, dim=-1)
    activated = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    if dtype == torch.bfloat16:   # rounded before the product, as two bf16 ops would
        activated = activated.to(dtype).float()
    expected = (activated * up).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol)
    # Each row alone gives the same bits.
    one = torch.empty(1, inter, dtype=dtype)
    fn(x[3:4].data_ptr(), x.stride(0), one.data_ptr(), one.stride(0), 1, inter, code, dtype == torch.bfloat16, 1)
    assert torch.equal(one[0], y[3])
