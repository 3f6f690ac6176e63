"""The scan for NaN and infinity in a tensor's raw bytes (scan.c), with a numpy twin for machines
without a C compiler."""

from __future__ import annotations

import ctypes

import numpy as np

from conveyor.kernels import threads
from conveyor.kernels.build import KernelLibrary

FORMATS = {"f32": 0, "bf16": 1, "f16": 2}     # half.h's element formats
_WIDTH = {"f32": 4, "bf16": 2, "f16": 2}
_MASKS = {"f32": 0x7F800000, "bf16": 0x7F80, "f16": 0x7C00}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _lib(built: KernelLibrary) -> ctypes.CDLL:
    lib = built.lib
    if not getattr(lib, "_scan_declared", False):
        lib.scan_nonfinite.restype = _I64
        lib.scan_nonfinite.argtypes = [_P, _I64, _I64, _I64, _I64, ctypes.c_int, _I64]
        lib._scan_declared = True
    return lib


def first_nonfinite(built: KernelLibrary | None, raw: np.ndarray, block_bytes: int, offset: int,
                    num_fields: int, fmt: str) -> int:
    """The index of the first block of `raw` (contiguous uint8, whole blocks of `block_bytes`) whose
    `num_fields` values of `fmt` at byte `offset` hold a NaN or an infinity; -1 when none does."""
    width = _WIDTH[fmt]
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous or raw.nbytes % block_bytes \
            or offset < 0 or offset + num_fields * width > block_bytes:
        raise ValueError(f"cannot scan {raw.nbytes} bytes as blocks of {block_bytes} with {num_fields} "
                         f"{fmt} values at byte {offset}")
    num_blocks = raw.nbytes // block_bytes
    if num_blocks == 0:
        return -1
    if built is not None:
        return int(_lib(built).scan_nonfinite(raw.ctypes.data, num_blocks, block_bytes, offset, num_fields,
                                              FORMATS[fmt], threads.num_threads()))
    blocks = raw.reshape(num_blocks, block_bytes)[:, offset: offset + num_fields * width]
    values = np.ascontiguousarray(blocks).view(np.uint32 if width == 4 else np.uint16)
    bad = ((values & _MASKS[fmt]) == _MASKS[fmt]).any(axis=1)
    return int(np.argmax(bad)) if bad.any() else -1
