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

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@cache
def library_for(features: frozenset[str]) -> KernelLibrary | None:
    """The kernels built for `features` (the CPU's, or a subset of them to run narrower code paths)."""
    built = build(features)
    if built is None:
        return None
    lib = built.lib
    lib.paged_decode_f32.restype = ctypes.c_int
    lib.paged_decode_f32.argtypes = [_P] * 4 + [_I64, _P] + [_I64] * 6 + [_F32, _P, _I64]
    for name in ("gemm_f32", "gemm_bf16"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]
    lib.gemm_isa.restype = ctypes.c_int
    lib.gemm_isa.argtypes = []
    return built


def library() -> KernelLibrary | None:
    """The kernels for this CPU, or None when they cannot be built."""
    return library_for(cpu_features())


def has_paged_decode() -> bool:
    return library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q: (B, H, D) float32 on CPU; caches (num_blocks, block_size, KV, D); block_tables (B, NB) int64;
    context_lens (B,) int64. Returns (B, H, D). The ctypes call releases the GIL."""
    built = library()
    assert built is not None and q.dtype == torch.float32 and k_cache.dtype == torch.float32
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    status = built.lib.paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), rows, num_heads, num_kv_heads, head_dim,
        block_size, window or 0, scale, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"paged_decode: unsupported shape (heads {num_heads}, kv heads {num_kv_heads}, "
                         f"head dim {head_dim}, block size {block_size})")
    return out
