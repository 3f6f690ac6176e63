"""Small C kernels for hot loops torch has no fused op for, built with the system C compiler on first use.

Every kernel has a pure-torch twin that is used when no compiler is present, and tests compare them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
# Reassociation lets gcc vectorise the dot products; finite-math stays off because the kernel uses -inf.
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fno-math-errno"]


def _build_dir() -> Path:
    local = Path(__file__).with_name("_build")
    try:
        local.mkdir(exist_ok=True)
        if os.access(local, os.W_OK):
            return local
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / "conveyor-kernels"
    fallback.mkdir(exist_ok=True)
    return fallback


@cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; decode attention uses the slower torch path")
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _build_dir() / f"paged_decode-{digest}.so"
    if not target.exists():
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([compiler, *_FLAGS, "-o", str(tmp), str(_SOURCE), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building the decode attention kernel failed; using the torch path:\n%s",
                           result.stderr[-2000:])
            return None
        os.replace(tmp, target)  # atomic, so concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(target))
    lib.paged_decode_f32.restype = ctypes.c_int
    lib.paged_decode_f32.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 6
        + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64])
    return lib


def has_paged_decode() -> bool:
    return _library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q: (B, H, D) float32 on CPU; caches (num_blocks, block_size, KV, D); block_tables (B, NB) int64;
    context_lens (B,) int64. Returns (B, H, D). The ctypes call releases the GIL."""
    lib = _library()
    assert lib is not None and q.dtype == torch.float32 and k_cache.dtype == torch.float32
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    status = lib.paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), rows, num_heads, num_kv_heads, head_dim,
        block_size, window or 0, scale, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"paged_decode: unsupported shape (heads {num_heads}, kv heads {num_kv_heads}, "
                         f"head dim {head_dim}, block size {block_size})")
    return out
