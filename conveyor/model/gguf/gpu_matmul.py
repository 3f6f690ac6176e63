"""Fused dequantize-matmul on a CUDA GPU, in Triton where it is installed.

A decode step's matmuls are bound by reading the weights: dequantizing a whole layer to bfloat16 first
writes and reads 16 bits a weight (and more in float32 temporaries), where the blocks hold 4.5 to 8.5.
This kernel reads each layer's blocks once per tile of up to 64 rows of x (a decode step of up to 64
sequences: once), dequantizes a (BLOCK_N, 256) tile in registers and multiplies it with those rows on
the tensor cores (rows padded to 16). The torch path (gpu_quant.py) is its reference: the tile is
dequantized with the same float32 ops and rounded to the activations' dtype before the product.
"""

from __future__ import annotations

import functools

import torch

# GGUF types the kernel reads: (weights per block, bytes per block), as gpu_quant.BLOCKS.
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
_CODES = {name: i for i, name in enumerate(FORMATS)}


@functools.cache
def _kernel():  # noqa: ANN202 - a triton.JITFunction, or None without Triton
    try:
        from conveyor.model.gguf import triton_matmul
    except ImportError:
        return None
    return triton_matmul.matmul


def available() -> bool:
    return _kernel() is not None


def applies(x: torch.Tensor, formats: list[str]) -> bool:
    """Whether this matmul takes the fused kernel: 16-bit activations on a CUDA GPU with bfloat16 tensor
    cores (float32 ones take the torch path, exact to the file's weights)."""
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and all(f in FORMATS for f in formats) and available() and _has_tensor_cores(x.device.index))


@functools.cache
def _has_tensor_cores(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def matmul(type_name: str, raw: torch.Tensor, x: torch.Tensor, block_n: int = 16) -> torch.Tensor:
    """x (T, K) @ W.T for W the uint8 (N, bytes per row) blocks of `type_name`. Also runs on CPU tensors
    under TRITON_INTERPRET=1 (the tests)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fused GGUF matmul needs Triton")
    block, size = FORMATS[type_name]
    num_rows, k = x.shape
    if k % block or raw.shape[1] != k // block * size:
        raise ValueError(f"{type_name} matmul: x {tuple(x.shape)} does not fit blocks {tuple(raw.shape)}")
    x = x.contiguous()
    n = raw.shape[0]
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:   # a step that samples no row (a prompt chunk) asks the output layer for nothing
        return y
    rows = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64   # tl.dot takes 16 at least
    grid = (-(-n // block_n), -(-num_rows // rows))
    kernel[grid](raw, x, y, num_rows, n, k, raw.stride(0), 256 // block * size, -(-k // 256),
                 FMT=_CODES[type_name], SIZE=size, BLOCK_N=block_n, ROWS=rows)
    return y
