"""Weights kept quantized (Q8, Q4_0, Q4_1 in blocks of 32 along K) and their matmul (quant.c).

Every format is stored as unsigned codes with a zero point, w = d * (code - zp) (+ m for Q4_1), so
one kernel serves all three: Q8 codes are q + 128 (zp 128), Q4_0 codes are GGUF's nibbles (zp 8),
Q4_1 codes are its nibbles with zp 0 and a per-block min. Scales and mins stay fp16 as in GGUF, so
repacking a GGUF tensor is lossless. The packed layout is described at the top of quant.c.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.kernels import threads
from conveyor.kernels.build import KernelLibrary

QK = 32      # weights per block along K
PANEL = 32   # output channels per panel
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
ZERO_POINTS = {"q8_0": 128, "q4_0": 8, "q4_1": 0}
CODE_BYTES = {"q8_0": 1024, "q4_0": 512, "q4_1": 512}
BLOCK_BYTES = {"q8_0": 1088, "q4_0": 576, "q4_1": 640}   # per block of 32 channels x 32 k

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class QuantWeight:
    """A (N, K) weight repacked for quant.c: `data` is uint8 (P, K/32, BLOCK_BYTES[fmt])."""

    fmt: str
    n: int
    k: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _lib(built: KernelLibrary) -> ctypes.CDLL:
    lib = built.lib
    if not getattr(lib, "_quant_declared", False):
        lib.quant_gemm.restype = ctypes.c_int
        lib.quant_gemm.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64]
        lib.quant_activations.restype = ctypes.c_int
        lib.quant_activations.argtypes = [_P, _I64, _I64, _I64, _P, _P]
        lib.quant_isa.restype = ctypes.c_int
        lib.quant_isa.argtypes = []
        lib._quant_declared = True
    return lib


def isa(built: KernelLibrary) -> str:
    return ("portable", "avx2", "avx512-vnni")[_lib(built).quant_isa()]


def pack(fmt: str, codes: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> QuantWeight:
    """codes uint8 (N, K) (already offset by the zero point), d and m float16 (N, K/32) -> QuantWeight."""
    n, k = codes.shape
    if k % QK:
        raise ValueError(f"quantized weights need K divisible by {QK}, got {k}")
    kb, panels = k // QK, -(-n // PANEL)
    pad = panels * PANEL - n
    codes = np.pad(codes, ((0, pad), (0, 0)))               # zero codes with zero scales: zero weights
    d = np.pad(d.astype(np.float16), ((0, pad), (0, 0)))
    # (P, 32 ch, KB, 8 groups, 4 k) -> (P, KB, 8, 32, 4): 4 consecutive k of a channel per 32-bit lane.
    c = codes.reshape(panels, PANEL, kb, 8, 4).transpose(0, 2, 3, 1, 4)
    if fmt != "q8_0":
        c = c[:, :, :, :16] | (c[:, :, :, 16:] << 4)           # low nibble: ch c, high: ch c + 16
    parts = [np.ascontiguousarray(c).reshape(panels, kb, -1),
             np.ascontiguousarray(d.reshape(panels, PANEL, kb).transpose(0, 2, 1)).view(np.uint8)]
    if fmt == "q4_1":
        m = np.pad(m.astype(np.float16), ((0, pad), (0, 0)))
        parts.append(np.ascontiguousarray(m.reshape(panels, PANEL, kb).transpose(0, 2, 1)).view(np.uint8))
    data = np.concatenate(parts, axis=2)
    assert data.shape[2] == BLOCK_BYTES[fmt]
    return QuantWeight(fmt, n, k, torch.from_numpy(data))


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per 32-block of K (Q8_0): the kernel scales every block by the activation's
    scale anyway, so a per-block weight scale costs no extra work and tracks outliers better than
    one scale per output channel."""
    w = weight.detach().float().numpy()
    n, k = w.shape
    blocks = w.reshape(n, k // QK, QK)
    d = (np.abs(blocks).max(axis=2) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, :, None]
    q = np.where(d32 > 0, np.rint(blocks / np.where(d32 > 0, d32, 1.0)), 0.0).clip(-127, 127)
    return pack("q8_0", (q.astype(np.int16) + 128).astype(np.uint8).reshape(n, k), d)


def from_gguf_blocks(fmt: str, raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """GGUF block bytes (N, K/32 * block size) of Q8_0 / Q4_0 / Q4_1 -> QuantWeight, losslessly."""
    kb = k // QK
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    b = np.ascontiguousarray(raw).reshape(n, kb, size)
    d = b[:, :, 0:2].copy().view(np.float16).reshape(n, kb)
    if fmt == "q8_0":
        q = b[:, :, 2:].view(np.int8).astype(np.int16) + 128
        return pack(fmt, q.astype(np.uint8).reshape(n, k), d)
    nib = b[:, :, 4:] if fmt == "q4_1" else b[:, :, 2:]
    codes = np.concatenate([nib & 15, nib >> 4], axis=2).reshape(n, k)   # GGUF: k < 16 low, k >= 16 high
    m = b[:, :, 2:4].copy().view(np.float16).reshape(n, kb) if fmt == "q4_1" else None
    return pack(fmt, codes, d, m)


def concat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Stack weights of one format along N (fused q/k/v or gate/up): unpack to codes and repack."""
    fmt, k = weights[0].fmt, weights[0].k
    codes, ds, ms = zip(*(_unpack(w) for w in weights))
    return pack(fmt, np.concatenate(codes), np.concatenate(ds), None if ms[0] is None else np.concatenate(ms))


def _unpack(w: QuantWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    data = w.data.numpy()
    panels, kb, _ = data.shape
    c = data[:, :, :CODE_BYTES[w.fmt]].reshape(panels, kb, 8, -1, 4)
    if w.fmt != "q8_0":
        c = np.concatenate([c & 15, c >> 4], axis=3)
    codes = c.transpose(0, 3, 1, 2, 4).reshape(panels * PANEL, w.k)[: w.n]

    def scales(offset: int) -> np.ndarray:
        s = data[:, :, offset: offset + 64].copy().view(np.float16)          # (P, KB, 32)
        return s.transpose(0, 2, 1).reshape(panels * PANEL, kb)[: w.n]

    cb = CODE_BYTES[w.fmt]
    return codes, scales(cb), scales(cb + 64) if w.fmt == "q4_1" else None


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 (N, K) weight that `w` stands for."""
    codes, d, m = _unpack(w)
    blocks = (codes.astype(np.float32) - ZERO_POINTS[w.fmt]).reshape(w.n, -1, QK)
    out = blocks * d.astype(np.float32)[:, :, None]
    if m is not None:
        out = out + m.astype(np.float32)[:, :, None]
    return torch.from_numpy(out.reshape(w.n, w.k))


def activations(built: KernelLibrary, x: torch.Tensor) -> torch.Tensor:
    """The rows of x (M, K) as the kernel sees them after int8 quantization (float32)."""
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK)
    if _lib(built).quant_activations(x.data_ptr(), k, m, k, q.data_ptr(), d.data_ptr()) != 0:
        raise ValueError(f"activations: K = {k} is not a multiple of {QK}")
    return (q.float().view(m, -1, QK) * d[:, :, None]).view(m, k)


def gemm(built: KernelLibrary, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
         num_threads: int | None = None) -> torch.Tensor:
    """x (..., K) float32 -> (..., N) float32 through the quantized weight."""
    x2 = x.reshape(-1, w.k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, w.n)
    status = _lib(built).quant_gemm(
        x2.data_ptr(), x2.stride(0), w.data.data_ptr(), FORMATS[w.fmt], 0 if bias is None else bias.data_ptr(),
        y.data_ptr(), w.n, rows, w.n, w.k, num_threads or threads.num_threads())
    if status != 0:
        raise ValueError(f"quant gemm failed ({status}): K = {w.k}, format {w.fmt}")
    y = y.view(*x.shape[:-1], w.n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)
