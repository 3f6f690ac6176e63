"""How many threads the C kernels use: the engine sets it; otherwise torch's own count.

The kernels run on their own pool (pool.c), so torch's thread count only matters for the few torch
ops left around them.
"""

from __future__ import annotations

import torch

_count: int | None = None


def set_num_threads(count: int | None) -> None:
    global _count
    if count is not None and count < 1:
        raise ValueError(f"kernel threads must be >= 1, got {count}")
    _count = count


def num_threads() -> int:
    return _count or torch.get_num_threads()
