"""A decoder layer's elementwise steps as single Triton kernels, for 16-bit activations on a CUDA GPU.

A GPU decode step of a small model costs its kernel count, not its arithmetic: replayed from a CUDA
graph, each of a layer's ~47 kernels still takes a few microseconds. In torch ops a bfloat16 RMSNorm is
eight kernels, RoPE five, SiLU-and-multiply two; here each is one (one row's decode on an H200: 3.24 ->
1.96 ms a step on a Qwen2.5-0.5B shape). The arithmetic and the rounding to the 16-bit type after each
operation are the torch ops'; values may still differ by a 16-bit step where the GPU's exp or float32
summation order differs from torch's kernels. The torch ops stay the path everywhere else (CPU,
float32, no Triton); `available(x)` says whether `x` takes this one.
"""

from __future__ import annotations

import importlib.util

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
ENABLED = True   # the benchmarks turn it off to measure the torch ops beside these kernels in one run

def available(x: torch.Tensor) -> bool:
    """Whether the layers send `x` through these kernels: 16-bit, on a CUDA GPU, Triton installed. (The
    tests call the kernels on CPU tensors under Triton's interpreter, TRITON_INTERPRET=1.)"""
    return ENABLED and _HAVE_TRITON and x.is_cuda and x.dtype in _SIXTEEN_BIT


def _jit():  # noqa: ANN202 - the module of kernels
    from conveyor.kernels import triton_layer_jit

    return triton_layer_jit


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension of a (rows, n) tensor whose rows are contiguous,
    normalised in float32 and rounded to x's dtype before the weight multiplies, as RMSNorm's torch ops."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        _jit().rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), n, eps, BLOCK=_pow2(n))
    return out


def rotary_(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place: qk (T, heads, D) with unit stride along D; cos, signed_sin (T, D) in
    qk's dtype (layers.RotaryEmbedding.cos_sin's tables). Returns qk."""
    tokens, heads, d = qk.shape
    if tokens:
        _jit().rotary_kernel[(tokens, heads)](qk, cos, signed_sin, qk.stride(0), qk.stride(1), cos.stride(0),
                                              D=d, BLOCK=_pow2(d))
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension, (rows, 2n) -> (rows, n)."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _jit().silu_mul_kernel[(rows, -(-n // block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                        BLOCK=block)
    return out
