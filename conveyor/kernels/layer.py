"""Wrappers for the elementwise decoder kernels in layer.c (RMSNorm, SwiGLU activation, RoPE + cache write).

Each takes float32 or bfloat16 activations whose rows are contiguous, and does in one pass what takes
torch a chain of small ops. The ctypes calls release the GIL.
"""

from __future__ import annotations

import torch

from conveyor.kernels.build import KernelLibrary


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rmsnorm(lib: KernelLibrary, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = _rows(x)
    n = x.shape[-1]
    x2 = x.view(-1, n)
    y = torch.empty(x2.shape, dtype=x.dtype)
    lib.lib.rmsnorm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(), n, x2.shape[0], n, eps,
                    x.dtype == torch.bfloat16, torch.get_num_threads())
    return y.view(x.shape)


def silu_mul(lib: KernelLibrary, gate_up: torch.Tensor) -> torch.Tensor:
    """(M, 2I) -> (M, I): silu(gate) * up."""
    gate_up = _rows(gate_up)
    m, width = gate_up.shape
    y = torch.empty(m, width // 2, dtype=gate_up.dtype)
    lib.lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), width // 2, m, width // 2,
                     gate_up.dtype == torch.bfloat16, torch.get_num_threads())
    return y


def rope_cache(lib: KernelLibrary, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> None:
    """Rotate q and k of qkv (T, (H + 2 KV) * D) in place and store k and v at `slots` of the caches.

    cos, sin: (T, D) float32, sin signed as `RotaryEmbedding.cos_sin` makes it; caches in qkv's dtype,
    k_cache (num_blocks, KV, D, block_size) (transposed keys), v_cache (num_blocks, block_size, KV, D).
    """
    assert qkv.stride(-1) == 1 and k_cache.dtype == qkv.dtype and cos.dtype == torch.float32
    status = lib.lib.rope_cache(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim,
                                cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                                v_cache.data_ptr(), k_cache.shape[-1], qkv.dtype == torch.bfloat16,
                                torch.get_num_threads())
    if status != 0:
        raise ValueError(f"rope_cache: unsupported head dim {head_dim}")
