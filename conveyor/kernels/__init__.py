"""C kernels for the hot loops: packed-weight matmuls, paged attention, the elementwise decoder ops.

Built with the system C compiler on first use for the features of the CPU we run on (see build.py).
Every kernel has a torch twin used when no compiler is present, and tests compare them.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from conveyor.kernels import decoder, formats, threads
from conveyor.kernels.build import KernelLibrary, build, cpu_features, describe

__all__ = ["KernelLibrary", "library", "library_for", "use_sanitizers", "cpu_features", "describe",
           "attention_tile_size", "paged_attention", "mask_logits",
           "argmax_rows"]

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_sanitize = False


def use_sanitizers() -> None:
    """Build every library from now on with AddressSanitizer and UBSan: for tests and CI, in a python
    started with the ASan runtime (LD_PRELOAD=$(gcc -print-file-name=libasan.so)). Call it before the
    first library is built; one built earlier stays as it is."""
    global _sanitize
    if library_for.cache_info().currsize and not _sanitize:
        raise RuntimeError("use_sanitizers() must come before the first kernel library is built")
    _sanitize = True


@cache
def library_for(features: frozenset[str]) -> KernelLibrary | None:
    """The kernels built for `features` (the CPU's, or a subset of them to run narrower code paths)."""
    built = build(features, sanitize=_sanitize)
    if built is None:
        return None
    lib = built.lib
    formats.check(lib)   # compiled with the format table Python reads, or nothing runs
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P] + [_I64] * 6 + [_F32, _P, _I64, _I64,
                                                                                               _INT, _INT]
    lib.attention_tile_size.restype = _I64
    lib.attention_tile_size.argtypes = [_I64] * 4
    for name in ("gemm_f32", "gemm_bf16"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64]
    lib.rmsnorm.restype = None
    lib.rmsnorm.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, _F32, _INT, _I64]
    decoder.declare(lib)
    lib.gemm_isa.restype = ctypes.c_int
    lib.gemm_isa.argtypes = []
    lib.convert_fmt.restype = None
    lib.convert_fmt.argtypes = [_P, _INT, _P, _INT, _I64]
    lib.mask_logits.restype = None
    lib.mask_logits.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, _P]
    lib.argmax_rows.restype = ctypes.c_int
    lib.argmax_rows.argtypes = [_P, _I64, _I64, _I64, _P, _I64]
    lib.shm_allreduce.restype = ctypes.c_int
    lib.shm_allreduce.argtypes = [_P, _I64, _P, _I64, _INT, _INT, _I64, _P, _I64]
    return built


@cache
def library() -> KernelLibrary | None:
    """The kernels for this CPU, or None when they cannot be built (looked up once: hot paths call it)."""
    return library_for(cpu_features())


def attention_tile_size(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Queries per work item of the attention kernel for this shape; 0 when the kernel cannot take it."""
    built = library()
    return 0 if built is None else built.lib.attention_tile_size(num_heads, num_kv_heads, head_dim, block_size)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    rows: torch.Tensor, context_lens: torch.Tensor, tokens: torch.Tensor, tile_start: torch.Tensor,
                    scale: float, window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Attention for the queries listed by (rows, context_lens, tokens), in tiles given by tile_start.

    q, out: (T, H, D) float32 or bfloat16, each token's heads contiguous (q may be a strided view into
    a fused qkv buffer); k_cache (num_blocks, KV, D, block_size) (keys transposed per block), v_cache
    (num_blocks, block_size, KV, D), both float32, bfloat16 or float16, or int8 code views with their
    scales in the blocks (model/kv_quant.py); block_tables (R, NB);
    query i is token tokens[i] of row rows[i] and sees context_lens[i] keys. All index tensors int64.
    Returns `out`. The ctypes call releases the GIL.
    """
    built = library()
    assert built is not None and q.dtype in (torch.float32, torch.bfloat16) and out.dtype == q.dtype
    assert k_cache.dtype in decoder.KV_FORMATS and v_cache.dtype == k_cache.dtype
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
    status = built.lib.paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], rows.data_ptr(), context_lens.data_ptr(), tokens.data_ptr(), tile_start.data_ptr(),
        tile_start.shape[0] - 1, num_heads, num_kv_heads, head_dim, block_size, window or 0, scale,
        out.data_ptr(), out.stride(0), threads.num_threads(), decoder.KV_FORMATS[q.dtype],
        decoder.KV_FORMATS[k_cache.dtype])
    if status != 0:
        raise ValueError(f"paged_attention: unsupported shape (heads {num_heads}, kv heads {num_kv_heads}, "
                         f"head dim {head_dim}, block size {block_size}) or tiles")
    return out


def convert(src: torch.Tensor, dtype: torch.dtype, library: KernelLibrary | None = None) -> torch.Tensor:
    """src (contiguous, float32 / bfloat16 / float16) as `dtype`, converted by the kernels' own code (the
    one that writes the KV cache), rounding to nearest even."""
    built = library or library_for(cpu_features())
    assert built is not None and src.is_contiguous()
    out = torch.empty(src.shape, dtype=dtype)
    built.lib.convert_fmt(src.data_ptr(), decoder.KV_FORMATS[src.dtype], out.data_ptr(), decoder.KV_FORMATS[dtype],
                          src.numel())
    return out


def mask_logits(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> list[bool] | None:
    """-inf in place for the tokens each listed row's packed mask refuses; per row, whether a finite logit
    is left. logits (S, V) float32 with unit column stride, rows (C,) int64, masks (C, words) int32
    contiguous. None when the kernels are not built (the caller has a torch path)."""
    built = library()
    if built is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        return None
    rows, masks = rows.contiguous(), masks.contiguous()
    alive = torch.empty(rows.shape[0], dtype=torch.int32)
    built.lib.mask_logits(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.shape[0], masks.data_ptr(),
                          masks.shape[1], logits.shape[1], alive.data_ptr())
    return [bool(a) for a in alive.tolist()]


def argmax_rows(logits: torch.Tensor, built: KernelLibrary | None = None) -> torch.Tensor | None:
    """(S, V) float32 on the CPU with unit column stride -> (S,) int64: each row's first index of its largest
    value, a NaN counting as largest (torch's and numpy's argmax), split across the kernels' threads. None
    when the kernels are not built or the tensor is not one they take (the caller has its own path).
    `built`: another build than this CPU's (tests run each code path)."""
    built = built or library()
    if (built is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[0] == 0 or logits.shape[1] == 0):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if built.lib.argmax_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                             threads.num_threads()) != 0:
        return None
    return out
