"""Weights kept quantized in GGUF's block formats, and the linear layer over them (quant.c, kquant_k.c,
kquant.c).

Q8_0 / Q4_0 / Q4_1 (and int8 made from float checkpoints) are stored as unsigned codes with a zero
point, w = d * (code - zp) (+ m for Q4_1), in the layout described at the top of quant.c; Q5_0, Q5_1,
IQ4_NL, IQ4_XS, Q3_K, Q4_K, Q5_K and Q6_K keep their own scales and are repacked in C straight from
the file's blocks (kquant_repack.c). Every repacking is lossless. Codes, block sizes and layouts come
from kernels.h's format table (formats.py). A linear layer is a list of segments along N, each in its
own format, sharing one quantization of the activations (a fused q/k/v whose parts differ).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.kernels import formats, threads
from conveyor.kernels.build import KernelLibrary

QK = formats.QK   # weights per block along K
PANEL = 32        # output channels per panel
FORMATS = {f.name: f.code for f in formats.FORMATS.values()}   # our name -> the kernels' format code
LEGACY = tuple(f.name for f in formats.FORMATS.values() if f.legacy)   # quant.c's kernels and layout
K_QUANTS = tuple(f.name for f in formats.FORMATS.values() if f.act_group == 256)   # llama.cpp's Q8_K activations
BLOCK_WEIGHTS = {f.name: f.block_weights for f in formats.FORMATS.values()}       # per file block along K
# The legacy layout, which this module packs itself: a block of 32 channels x 32 k is its codes, then scales.
ZERO_POINTS = {name: formats.FORMATS[name].zero_point for name in LEGACY}
CODE_BYTES = {name: formats.FORMATS[name].low_bytes for name in LEGACY}
BLOCK_BYTES = {name: formats.FORMATS[name].unit_bytes for name in LEGACY}

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
MAX_SEGMENTS = 4   # KQ_MAX_SEGMENTS


class _Segment(ctypes.Structure):
    _fields_ = [("fmt", _I64), ("n", _I64), ("w", _P), ("bias", _P)]


class LinearSpec(ctypes.Structure):
    """kernels.h's kq_linear_t: the segments of one quantized linear layer."""
    _fields_ = [("num_segments", _I64), ("k", _I64), ("seg", _Segment * MAX_SEGMENTS)]


@dataclass(frozen=True)
class QuantWeight:
    """A (N, K) weight repacked for the kernels: `data` is uint8 (P, K/32, BLOCK_BYTES[fmt]) for quant.c's
    formats, the flat panels of kquant.c's layout for the others (kq_packed_bytes long)."""

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
        lib.quant_activations.restype = ctypes.c_int
        lib.quant_activations.argtypes = [_P, _I64, _I64, _I64, _P, _P]
        lib.kq_activations_k.restype = ctypes.c_int
        lib.kq_activations_k.argtypes = [_P, _I64, _I64, _I64, _P, _P]
        lib.kq_linear.restype = ctypes.c_int
        lib.kq_linear.argtypes = [_P, _I64, ctypes.POINTER(LinearSpec), _P, _I64, _I64, _I64]
        lib.kq_repack.restype = ctypes.c_int
        lib.kq_repack.argtypes = [ctypes.c_int, _P, _I64, _P, _I64, _I64, _P, _I64]
        lib.kq_packed_bytes.restype = _I64
        lib.kq_packed_bytes.argtypes = [ctypes.c_int, _I64, _I64]
        lib.kn_linear_bytes.restype = _I64
        lib.kn_embed_rows.restype = ctypes.c_int
        lib.kn_embed_rows.argtypes = [ctypes.c_int, _P, _I64, _I64, _P, _I64, _I64, _P]
        if lib.kn_linear_bytes() != ctypes.sizeof(LinearSpec):
            raise RuntimeError("quant.LinearSpec does not match kernels.h's kq_linear_t")
        lib._quant_declared = True
    return lib


def isa(built: KernelLibrary) -> str:
    """The code path every quantized format runs on in this build (portable, avx2, avx2-vnni, avx512-vnni)."""
    return formats.isa_name(built.lib)


def can_keep(fmt: str, k: int) -> bool:
    """Whether a weight of this format with K = k runs on the quantized kernels."""
    return fmt in FORMATS and k % BLOCK_WEIGHTS[fmt] == 0


def repack(built: KernelLibrary, fmt: str, raw: np.ndarray, n: int, k: int,
           rows: np.ndarray | None = None, num_threads: int | None = None) -> QuantWeight:
    """A GGUF tensor's blocks (file rows of `raw`, uint8 (rows, row bytes), e.g. a memory map) -> QuantWeight.

    `rows` picks the file row of each output channel (a permutation), None for the identity. The
    repacking runs in C (kquant.c) without a copy of `raw`; it equals `from_gguf_blocks` for the legacy
    formats.
    """
    if not can_keep(fmt, k):
        raise ValueError(f"{fmt} weights need K divisible by {BLOCK_WEIGHTS[fmt]}, got {k}")
    lib = _lib(built)
    raw = raw if raw.flags.c_contiguous else np.ascontiguousarray(raw)
    order = None if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    size = lib.kq_packed_bytes(FORMATS[fmt], n, k)
    data = _weight_buffer(size)
    status = lib.kq_repack(FORMATS[fmt], raw.ctypes.data, raw.shape[1] if raw.ndim == 2 else raw.nbytes // n,
                           None if order is None else order.ctypes.data, n, k, data.data_ptr(),
                           num_threads or threads.num_threads())
    if status != 0:
        raise ValueError(f"cannot repack a {fmt} tensor of shape ({n}, {k})")
    if fmt in LEGACY:   # quant.c's (P, K/32, block bytes) view
        data = data.view(-(-n // PANEL), k // QK, BLOCK_BYTES[fmt])
    return QuantWeight(fmt, n, k, data)


_HUGE_PAGE = 2 << 20
_libc = None


def _weight_buffer(size: int) -> torch.Tensor:
    """An uninitialised buffer for a repacked weight, backed by 2 MiB pages where the kernel allows
    (transparent huge pages on request): a decode step streams every weight once, and 4 KiB pages
    cost it a page walk every 4 KiB."""
    global _libc
    if size < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(size, dtype=torch.uint8)
    data = torch.empty(size + _HUGE_PAGE, dtype=torch.uint8)   # the pages outside the slice are never touched
    start = (-data.data_ptr()) % _HUGE_PAGE
    data = data[start:start + size]
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise(data.data_ptr(), size // _HUGE_PAGE * _HUGE_PAGE, 14)   # MADV_HUGEPAGE: advice, may be ignored
    return data


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
    size = formats.FORMATS[fmt].block_bytes
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


def activations(built: KernelLibrary, x: torch.Tensor, fmt: str = "q8_0") -> torch.Tensor:
    """The rows of x (M, K) as the kernel for `fmt` sees them after int8 quantization (float32): one
    scale per 32 k, or per 256 k for the K-quants."""
    x = x.float().contiguous()
    m, k = x.shape
    group = 256 if fmt in K_QUANTS else QK
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // group)
    quantize = _lib(built).kq_activations_k if group == 256 else _lib(built).quant_activations
    if quantize(x.data_ptr(), k, m, k, q.data_ptr(), d.data_ptr()) != 0:
        raise ValueError(f"activations: K = {k} is not a multiple of {group}")
    return (q.float().view(m, -1, group) * d[:, :, None]).view(m, k)


def linear_spec(weights: list[QuantWeight], bias: torch.Tensor | None) -> LinearSpec:
    """The C description of a linear layer made of `weights` stacked along N; `bias` (sum of n,) float32
    contiguous or None. The tensors must outlive the spec."""
    if not 1 <= len(weights) <= MAX_SEGMENTS or len({w.k for w in weights}) != 1:
        raise ValueError(f"a quantized linear takes 1 to {MAX_SEGMENTS} weights of one K")
    spec = LinearSpec(len(weights), weights[0].k)
    offset = 0
    for i, w in enumerate(weights):
        bias_ptr = None if bias is None else bias.data_ptr() + 4 * offset
        spec.seg[i] = _Segment(FORMATS[w.fmt], w.n, w.data.data_ptr(), bias_ptr)
        offset += w.n
    return spec


def run_linear(built: KernelLibrary, x: torch.Tensor, spec: LinearSpec, n: int,
               num_threads: int | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) float32 through a LinearSpec of N output channels in all."""
    k = spec.k
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, n)
    status = _lib(built).kq_linear(x2.data_ptr(), x2.stride(0), ctypes.byref(spec), y.data_ptr(), n, rows,
                                   num_threads or threads.num_threads())
    if status != 0:
        raise ValueError(f"quantized linear failed ({status}): K = {k}")
    y = y.view(*x.shape[:-1], n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def gemm(built: KernelLibrary, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
         num_threads: int | None = None) -> torch.Tensor:
    """x (..., K) float32 -> (..., N) float32 through one quantized weight."""
    bias = None if bias is None else bias.float().contiguous()
    return run_linear(built, x, linear_spec([w], bias), w.n, num_threads)


EMBED_FORMATS = ("q8_0", "q4_0", "q5_0")   # embed.c's


def embed_rows(built: KernelLibrary, fmt: str, table: int, num_rows: int, row_bytes: int, ids: torch.Tensor,
               k: int) -> torch.Tensor:
    """Rows `ids` (T,) int64 of a (num_rows, k) token table at address `table` in the file's blocks of `fmt`
    (one of EMBED_FORMATS) -> (T, k) float32."""
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], k)
    status = _lib(built).kn_embed_rows(FORMATS[fmt], table, num_rows, row_bytes, ids.data_ptr(), ids.shape[0], k,
                                       out.data_ptr())
    if status == -3:
        raise IndexError(f"a token id is outside the embedding table of {num_rows} rows")
    if status != 0:
        raise ValueError(f"embedding lookup refused ({status}): format {fmt}, K = {k}, {row_bytes} bytes a row")
    return out
