"""RMSNorm from layer.c for the final norm (inside the decoder layers, decoder.c calls layer.c itself).

Takes float32 or bfloat16 rows, and does in one pass what takes torch a chain of small ops. The
ctypes call releases the GIL.
"""

from __future__ import annotations

import torch

from conveyor.kernels import threads
from conveyor.kernels.build import KernelLibrary


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rmsnorm(lib: KernelLibrary, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = _rows(x)
    n = x.shape[-1]
    x2 = x.view(-1, n)
    y = torch.empty(x2.shape, dtype=x.dtype)
    lib.lib.rmsnorm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(), n, x2.shape[0], n, eps,
                    x.dtype == torch.bfloat16, threads.num_threads())
    return y.view(x.shape)
