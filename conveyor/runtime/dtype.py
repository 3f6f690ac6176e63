"""The working dtype of weights, activations and KV cache: explicit, or chosen for the hardware ("auto")."""

from __future__ import annotations

import torch

from conveyor.kernels import KernelLibrary

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "int8": torch.int8}   # int8: codes with per-token scales (model/kv_quant.py)


def choose_dtype(name: str, device: torch.device, library: KernelLibrary | None,
                 quantized: bool = False) -> tuple[torch.dtype, str]:
    """(dtype, why). "auto" takes bfloat16 where the hardware multiplies it natively and float32 elsewhere.

    On CPU, bfloat16 halves the bytes a decode step streams and doubles the matmul rate, but only with a
    native bf16 dot product (AVX-512 BF16); without one it is widened in software and runs slower than
    float32 (measured in BENCHMARKS.md), so float32 stays.
    """
    if name != "auto":
        return DTYPES[name], "as requested"
    if quantized:
        return torch.float32, "auto: quantized weights run with float32 activations"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bfloat16"
        return torch.float16, "auto: the GPU has no bfloat16"
    if library is None:
        return torch.float32, "auto: no C kernels on this machine, and torch's bfloat16 path is slower than float32"
    if "avx512_bf16" in library.features:
        return torch.bfloat16, "auto: this CPU has AVX-512 BF16 dot products, where bfloat16 runs faster than float32"
    return torch.float32, "auto: this CPU has no native bfloat16 dot product, so float32 is faster"


def choose_kv_dtype(name: str, dtype: torch.dtype, quantized: bool) -> tuple[torch.dtype, str]:
    """(the KV cache's dtype, why). "auto" keeps float16 beside quantized weights: decode attention
    reads the cache from memory, so half the bytes is nearly half the time at long contexts, and the
    model's own numbers are already rounded far more coarsely than float16 rounds them (llama.cpp's
    default too). Otherwise the working dtype."""
    if name != "auto":
        return KV_DTYPES[name], "as requested"
    if quantized:
        return torch.float16, "auto: beside quantized weights"
    return dtype, "auto: the working dtype"
