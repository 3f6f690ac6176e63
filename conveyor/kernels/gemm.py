"""Packed-weight matmul: pack a (N, K) weight once, then y = x @ W.T (+ bias) through the C kernel.

The packed layout (see gemm.c) puts 32 output channels side by side along K, so one panel streams
contiguously and every loaded weight vector serves all rows of the batch tile.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from conveyor.kernels import KernelLibrary, threads

PANEL = 32                         # output channels per packed panel (NR in gemm.c)
DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> float32 (P, K, 32) or bfloat16 (P, K/2, 32, 2), P = ceil(N / 32), zero-padded."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight, (0, 0, 0, panels * PANEL - n))                      # (P*32, K)
    if weight.dtype == torch.float32:
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()
    return padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: the (N, K) weight back (for embeddings tied to a packed output layer)."""
    if packed.dtype == torch.float32:
        panels, k, _ = packed.shape
        return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n]
    panels, half_k, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, half_k * 2)[:n]


def gemm(lib: KernelLibrary, x: torch.Tensor, packed: torch.Tensor, n: int,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) float32 or bfloat16 (the packed weight's dtype) -> (..., N) of the same dtype.

    With `residual` (..., N), contiguous rows, the result is x W^T + bias + residual, written into
    `residual` itself and returned: the skip connection costs no separate pass.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if residual is None:
        y = torch.empty(m, n, dtype=x.dtype)
        res_ptr = 0
    else:
        assert residual.dtype == x.dtype and residual.stride(-1) == 1 and residual.numel() == m * n
        y = residual.view(m, n)
        res_ptr = y.data_ptr()
    if m:
        fn = lib.lib.gemm_f32 if packed.dtype == torch.float32 else lib.lib.gemm_bf16
        status = fn(x2.data_ptr(), x2.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    res_ptr, y.stride(0), y.data_ptr(), y.stride(0), m, n, k, threads.num_threads())
        if status != 0:
            raise ValueError(f"gemm: unsupported shape (K = {k}, dtype {x.dtype})")
    return y.view(*x.shape[:-1], n)
