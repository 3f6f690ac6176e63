"""The Triton layer kernels give the torch ops' results, rounding included (kernels/triton_layer.py).

They run where the layers use them (16-bit on a CUDA GPU), or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1 set before Python starts); elsewhere this file skips.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from conveyor.model.layers import GatedMLP, RMSNorm, apply_rotary

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA GPU, and Triton's interpreter is off (TRITON_INTERPRET=1)", allow_module_level=True)

from conveyor.kernels import triton_layer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A GPU rounds to nearest as torch does, but its exp and the compiler's float32 order differ from torch's
# kernels (a step at most); the interpreter truncates 16-bit results (a step off at most per rounding).
STEPS = 2 if torch.cuda.is_available() else 3


def steps_apart(got: torch.Tensor, want: torch.Tensor) -> float:
    """The most steps of `want`'s 16-bit type between the two tensors' values."""
    mantissa = 7 if want.dtype == torch.bfloat16 else 10
    _, exponent = torch.frexp(want.float())
    step = torch.ldexp(torch.ones_like(want, dtype=torch.float32), exponent - 1 - mantissa)
    return float(((got.float() - want.float()).abs() / step).max())


def _torch_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n", [(1, 576), (5, 896), (3, 64), (2, 100)])
def test_rms_norm_equals_the_torch_ops(dtype: torch.dtype, rows: int, n: int) -> None:
    torch.manual_seed(rows * n)
    norm = RMSNorm(n, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n) * 0.5 + 1)
    x = (torch.randn(rows, n) * 3).to(DEVICE, dtype)
    with torch.no_grad():
        got = triton_layer.rms_norm(x, norm.weight, norm.eps)
        want = _torch_rms_norm(norm, x)
    # float32 sums in another order may move a value by one 16-bit step, never more
    assert got.dtype == want.dtype and steps_apart(got, want) <= STEPS
    assert (got != want).float().mean() < (0.1 if torch.cuda.is_available() else 0.8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_in_place_equals_apply_rotary_on_a_strided_view(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, heads, kv_heads, d = 7, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(DEVICE, dtype)
    angles = torch.arange(tokens)[:, None] * torch.rand(d // 2)[None, :] * 3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(DEVICE, dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(DEVICE, dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, -1, d)        # the layer's view: token stride > heads * d
    want = apply_rotary(qk.clone(), cos[:, None, :], sin[:, None, :])
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    got = triton_layer.rotary_(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    # a sum of two rounded products: a step of a term is a step of the sum's magnitude, which may cancel
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=0.05)
    assert (got != want).float().mean() < (0.1 if torch.cuda.is_available() else 0.8)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)   # v untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (4, 4864), (3, 100)])
def test_silu_mul_equals_the_torch_ops(dtype: torch.dtype, rows: int, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter) * 2).to(DEVICE, dtype)
    gate, up = gate_up.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = triton_layer.silu_mul(gate_up)
    assert got.shape == want.shape and steps_apart(got, want) <= STEPS
    assert (got != want).float().mean() < (0.1 if torch.cuda.is_available() else 0.8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers take the kernels on a CUDA GPU only")
def test_layers_take_the_kernels_on_a_gpu() -> None:
    torch.manual_seed(1)
    mlp = GatedMLP(64, 128, bias=False).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(x).split(128, dim=-1)
        want = mlp.down_proj(torch.nn.functional.silu(gate) * up)
    with torch.no_grad():
        assert torch.allclose(mlp(x).float(), want.float(), rtol=2 ** -6, atol=1e-3)
    assert triton_layer.available(x) and not triton_layer.available(x.float()) and not triton_layer.available(x.cpu())
