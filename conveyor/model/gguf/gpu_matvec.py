"""Fused dequantize-matmul for a few rows (a decode step) on a CUDA GPU, in Triton where it is installed.

A decode step's matmuls are bound by reading the weights: dequantizing a whole layer to bfloat16 first
writes and reads 16 bits a weight, where the blocks hold 4.5 to 8.5. This kernel reads each layer's blocks
once, dequantizes a (BLOCK_N, 256) tile in registers and multiplies it with the step's rows (at most
MAX_ROWS, padded to 16 for the tensor cores). The torch path (gpu_quant.py) is its reference: the tile is
dequantized with the same float32 ops and rounded to the activations' dtype before the product.
"""

from __future__ import annotations

import functools

import torch

MAX_ROWS = 8
# GGUF types the kernel reads: (weights per block, bytes per block), as gpu_quant.BLOCKS.
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
_CODES = {name: i for i, name in enumerate(FORMATS)}


@functools.cache
def _kernel():  # noqa: ANN202 - a triton.JITFunction, or None without Triton
    try:
        from conveyor.model.gguf import triton_matvec
    except ImportError:
        return None
    return triton_matvec.matvec


def available() -> bool:
    return _kernel() is not None


def applies(x: torch.Tensor, formats: list[str]) -> bool:
    """Whether this step's matmul takes the fused kernel: a few rows of 16-bit activations on CUDA."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and all(f in FORMATS for f in formats) and available())


def matvec(type_name: str, raw: torch.Tensor, x: torch.Tensor, block_n: int = 16) -> torch.Tensor:
    """x (T, K) @ W.T for W the uint8 (N, bytes per row) blocks of `type_name`; T <= MAX_ROWS. Also
    runs on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fused GGUF matvec needs Triton")
    block, size = FORMATS[type_name]
    num_rows, k = x.shape
    if num_rows > MAX_ROWS or k % block or raw.shape[1] != k // block * size:
        raise ValueError(f"{type_name} matvec: x {tuple(x.shape)} does not fit blocks {tuple(raw.shape)}")
    x = x.contiguous()
    n = raw.shape[0]
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    kernel[(-(-n // block_n),)](raw, x, y, num_rows, n, k, raw.stride(0), 256 // block * size,
                                FMT=_CODES[type_name], SIZE=size, BLOCK_N=block_n, ROWS=16)
    return y
