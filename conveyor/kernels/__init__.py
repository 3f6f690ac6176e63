"""C kernels for the hot loops: packed-weight matmuls and paged decode attention.

Built with the system C compiler on first use for the features of the CPU we run on (see build.py).
Every kernel has a torch twin used when no compiler is present, and tests compare them.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from conveyor.kernels.build import KernelLibrary, build, cpu_features, describe

__all__ = ["KernelLibrary", "library", "library_for", "cpu_features", "describe", "has_paged_decode",
           "paged_decode"]

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@cache
def library_for(features: frozenset[str]) -> KernelLibrary | None:
    """The kernels built for `features` (the CPU's, or a subset of them to run narrower code paths)."""
    built = build(features)
    if built is None:
        return None
    lib = built.lib
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P] + [_I64] * 6 + [_F32, _P, _I64, _I64, _INT]
    for name in ("gemm_f32", "gemm_bf16"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64]
    lib.rmsnorm.restype = None
    lib.rmsnorm.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, _F32, _INT, _I64]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _INT, _I64]
    lib.rope_cache.restype = ctypes.c_int
    lib.rope_cache.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _INT, _I64]
    lib.gemm_isa.restype = ctypes.c_int
    lib.gemm_isa.argtypes = []
    return built


@cache
def library() -> KernelLibrary | None:
    """The kernels for this CPU, or None when they cannot be built (looked up once: hot paths call it)."""
    return library_for(cpu_features())


def has_paged_decode() -> bool:
    return library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None, out: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, one query per row, float32 or bfloat16 (q's dtype, the caches' too).

    q: (T, H, D) with each token's heads contiguous (a strided view into a fused qkv buffer is fine);
    caches (num_blocks, block_size, KV, D); block_tables (B, NB) int64; context_lens (B,) int64.
    Row b's query is token `tokens[b]` of q (b itself without `tokens`) and its result goes to the
    same token of `out` (T, H, D), which is returned. The ctypes call releases the GIL.
    """
    built = library()
    assert built is not None and q.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == q.dtype
    rows = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    status = built.lib.paged_decode(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), 0 if tokens is None else tokens.data_ptr(), rows,
        num_heads, num_kv_heads, head_dim, block_size, window or 0, scale, out.data_ptr(), out.stride(0),
        torch.get_num_threads(), q.dtype == torch.bfloat16)
    if status != 0:
        raise ValueError(f"paged_decode: unsupported shape (heads {num_heads}, kv heads {num_kv_heads}, "
                         f"head dim {head_dim}, block size {block_size})")
    return out
