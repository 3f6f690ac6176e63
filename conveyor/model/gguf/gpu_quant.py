"""GGUF blocks kept as their raw bytes on the device (a CUDA GPU), dequantized in torch where they are used.

Each layer holds its tensors' blocks as a uint8 tensor (rows, bytes per row) and dequantizes them to the
activations' dtype with elementwise torch ops on every call (no host sync, no Python loop over blocks, so
a decode step that uses them can be captured in a CUDA graph), then multiplies. On CUDA with 16-bit
activations a fused Triton kernel dequantizes tiles in registers instead (gpu_matmul.py), where Triton
is installed. The
dequantization is gguf's `quants.dequantize`, op for op: float32 products of the float16 scales and the
integer quants, rounded once to the output dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.model.gguf import gpu_matmul

QK_K = 256
# GGUF type name -> (weights per block, bytes per block), as gguf.GGML_QUANT_SIZES gives them.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
          "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(n, 1) float32 of the float16 at `offset` of every block (little-endian, as the file stores it)."""
    return blocks[:, offset: offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, g, b) bytes -> (n, g, 2, b): the low nibbles, then the high ones."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """(n, b) bytes -> (n, count, b): bit i of every byte in row i (i < count)."""
    shifts = torch.arange(count, dtype=torch.uint8, device=qh.device).view(1, count, 1)
    return (qh.unsqueeze(1) >> shifts) & 1


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:].unsqueeze(1)).reshape(-1, 32)
    return _f16(b, 0) * (q.to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:].unsqueeze(1)).reshape(-1, 32)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    high = _bits(b[:, 2:6], 8).transpose(1, 2).reshape(-1, 32)   # element j: bit j % 8 of byte j // 8
    low = _nibbles(b[:, 6:].unsqueeze(1)).reshape(-1, 32)
    return _f16(b, 0) * ((low | (high << 4)).to(torch.int8) - 16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes of a Q4_K/Q5_K block, (n, 8) each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mins


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: d * scale * q - dmin * min per sub-block of 32; q is (n, 8, 32)."""
    sc, mins = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return (d * q.float() - dm).reshape(-1, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_scaled(b, low | (_bits(b[:, 16:48], 8) << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    d = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()      # (n, 16)
    return (d.unsqueeze(-1) * q).reshape(-1, QK_K)


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def can_keep(type_name: str, k: int) -> bool:
    """Whether rows of length k in this GGUF type run here (whole blocks per row)."""
    return type_name in BLOCKS and k % BLOCKS[type_name][0] == 0


def dequantize(type_name: str, raw: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, bytes per row) uint8 of one GGUF type -> (rows, k) in `dtype`."""
    block, size = BLOCKS[type_name]
    values = _DEQUANTIZE[type_name](raw.reshape(-1, size))
    return values.to(dtype).view(raw.shape[0], k)


def _check_raw(type_name: str, raw: torch.Tensor, k: int) -> None:
    if not can_keep(type_name, k):
        raise ValueError(f"{type_name} rows of {k} weights cannot run kept quantized")
    block, size = BLOCKS[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // block * size:
        raise ValueError(f"{type_name} rows of {k} weights take {k // block * size} bytes each, "
                         f"got a {raw.dtype} tensor of shape {tuple(raw.shape)}")


class GpuQuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W kept as GGUF blocks: segments along N (a fused q/k/v or gate/up whose
    parts differ in type), each a uint8 (n, bytes per row) buffer in its own type. Any float dtype in,
    the same dtype out."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        for type_name, raw in segments:
            _check_raw(type_name, raw, in_features)
        self.formats = [type_name for type_name, _ in segments]
        self.in_features = in_features
        self.out_features = sum(int(raw.shape[0]) for _, raw in segments)
        for i, (_, raw) in enumerate(segments):
            self.register_buffer(f"qdata{i}", raw)   # counted by model.buffers() for memory reports
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)

    def raw(self, i: int) -> torch.Tensor:
        return getattr(self, f"qdata{i}")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(out_features, in_features) in `dtype`."""
        parts = [dequantize(fmt, self.raw(i), self.in_features, dtype) for i, fmt in enumerate(self.formats)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gpu_matmul.applies(x, self.formats):
            y = torch.cat([gpu_matmul.matmul(fmt, self.raw(i), x) for i, fmt in enumerate(self.formats)], dim=-1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={'+'.join(self.formats)}"


class GpuQuantEmbedding(nn.Module):
    """Token embedding kept as GGUF blocks on the device: a lookup gathers and dequantizes only its rows."""

    def __init__(self, type_name: str, raw: torch.Tensor, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        _check_raw(type_name, raw, embedding_dim)
        self.type_name, self.dtype = type_name, dtype
        self.num_embeddings, self.embedding_dim = int(raw.shape[0]), embedding_dim
        self.register_buffer("qdata", raw)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.type_name, self.qdata[input_ids], self.embedding_dim, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.type_name}"
