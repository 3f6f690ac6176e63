"""The 8-bit KV cache's layout: int8 codes with one float16 scale per (token, KV head), kept in the block.

Each layer's K and V are blocks of `block_bytes` bytes; a block holds its codes, then their scales:

    keys, for the C kernel:  codes [KV, D, bs] (transposed, as its float keys), scales [KV, bs]
    keys, for torch:         codes [bs, KV, D],                                 scales [bs, KV]
    values:                  codes [bs, KV, D],                                 scales [bs, KV]

A token's key (or value) vector of one head is quantized alone when it is written: scale =
absmax / 127 rounded to float16, code = round(x / scale) (to nearest even), so its codes never depend
on what else is in the step. The C kernels (layer.c writes, attention.c reads) use the same layout and
the same arithmetic; a block moves (prefix copies, the disk tier, /slots) as plain bytes, scales with it.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
_ALIGN = 16   # bytes: each block starts on a 16-byte boundary


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's K (or V) block: codes, then float16 scales, padded to _ALIGN."""
    raw = block_size * num_kv_heads * head_dim + 2 * block_size * num_kv_heads
    return -(-raw // _ALIGN) * _ALIGN


def code_views(blocks: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
               transposed_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(K codes, V codes) of one layer: `blocks` is (2, num_blocks, block_bytes) int8. Views, strided by
    the block: K (num_blocks, KV, D, bs) when transposed, else (num_blocks, bs, KV, D); V (num_blocks, bs, KV, D)."""
    _, num_blocks, stride = blocks.shape
    plain = (num_blocks, block_size, num_kv_heads, head_dim)
    plain_strides = (stride, num_kv_heads * head_dim, head_dim, 1)
    k, v = blocks[0], blocks[1]
    if transposed_keys:
        k_view = k.as_strided((num_blocks, num_kv_heads, head_dim, block_size),
                              (stride, head_dim * block_size, block_size, 1))
    else:
        k_view = k.as_strided(plain, plain_strides)
    return k_view, v.as_strided(plain, plain_strides)


def scales_of(codes: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The float16 scales beside a code view of code_views: (num_blocks, KV, bs) for transposed keys,
    else (num_blocks, bs, KV). A view: writing it writes the blocks."""
    num_blocks = codes.shape[0]
    if transposed:
        _, kv, _, bs = codes.shape
        shape, strides = (num_blocks, kv, bs), (codes.stride(0) // 2, bs, 1)
    else:
        _, bs, kv, _ = codes.shape
        shape, strides = (num_blocks, bs, kv), (codes.stride(0) // 2, kv, 1)
    start = codes.storage_offset() + codes[0].numel()   # bytes: just past the first block's codes
    assert codes.stride(0) % 2 == 0 and start % 2 == 0, "int8 KV blocks keep their scales 2-byte aligned"
    out = torch.empty(0, dtype=SCALE_DTYPE, device=codes.device)
    return out.set_(codes.untyped_storage(), start // 2, shape, strides)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 (..., D), scales float16 (...)) of vectors x (..., D): absmax / 127 per vector."""
    x = x.float()
    scales = (x.abs().amax(dim=-1) / 127).to(SCALE_DTYPE)
    s = scales.float()[..., None]
    codes = torch.where(s > 0, (x / s).round().clamp(-127, 127), 0.0)
    return codes.to(torch.int8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D) times their scales (...), as `dtype`."""
    return (codes.float() * scales.float()[..., None]).to(dtype)
