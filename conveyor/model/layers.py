"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated (SwiGLU) MLP."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.kernels import KernelLibrary
from conveyor.kernels import layer as layer_kernels
from conveyor.kernels import triton_layer
from conveyor.kernels.gemm import gemm, pack


class Linear(nn.Linear):
    """nn.Linear without its random initialisation: every weight comes from the checkpoint, and
    initialising on the meta device imports torch's compiler stack (over a second of start-up)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its random initialisation (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels: KernelLibrary | None = None   # set by LlamaModel.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return layer_kernels.rmsnorm(self.kernels, x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        if triton_layer.available(x) and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            return triton_layer.rms_norm(x, self.weight, self.eps)   # the lines below in one kernel
        # Normalise in float32 and cast back before the weight, as Hugging Face does, so bf16 matches.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the attention scaling factor for a RoPE variant."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    attention_factor = 1.0
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    return inv_freq.float(), attention_factor


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) applied at arbitrary per-token positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None,
                 freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        # A plain attribute, not a buffer: building on the meta device and `to_empty` must not wipe it.
        self.inv_freq, self.attention_factor = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        # On the CPU, cos_sin's rows for positions 0..len-1, grown as positions come: a decode step looks
        # its row up instead of running the chain of small ops below (~0.15 ms of a step, cold caches).
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, (T, D) float32 each, for `apply_rotary` and the rope kernel."""
        if positions.device.type != "cpu" or self.inv_freq.device.type != "cpu":
            return self.compute(positions)
        if self._tables is not None:
            try:
                return self._tables[0].index_select(0, positions), self._tables[1].index_select(0, positions)
            except IndexError:   # a position past the tables: grow them
                pass
        cos, sin = self.tables(int(positions.max()) + 1 if positions.numel() else 0)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin's CPU tables, (L, D) each with L >= length: row p is position p's."""
        if self._tables is None or self._tables[0].shape[0] < length:
            # Elementwise ops, so a row is the same bits whichever batch computes it (tests/unit/test_rope_table.py).
            self._tables = self.compute(torch.arange(max(1024, 1 << (length - 1).bit_length())))
        return self._tables

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin's tables computed for these positions."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]   # (T, D/2)
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: the sign moves into the table.
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (T, H, D); cos/signed_sin: (T, 1, D) from `RotaryEmbedding.cos_sin`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused in one matmul: SwiGLU (silu), GeGLU (gelu_tanh)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(act(gate(x)) * up(x)), plus `residual` when given (which may be overwritten with it)."""
        gate_up = self.gate_up_proj(x)                                    # (T, 2I)
        if self.activation == "silu" and triton_layer.available(gate_up) and gate_up.is_contiguous():
            return linear_residual(self.down_proj, triton_layer.silu_mul(gate_up), residual)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear_residual(self.down_proj, self.act(gate) * up, residual)


def linear_residual(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + linear(x); a packed layer adds the residual in its matmul's epilogue, in place."""
    if residual is None:
        return linear(x)
    if isinstance(linear, PackedLinear) and residual.is_contiguous():
        return linear(x, residual=residual)
    return residual + linear(x)


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed for the C matmul kernel (kernels/gemm.py); no float copy is kept."""

    def __init__(self, lib: KernelLibrary, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        self.packed = nn.Parameter(pack(weight.detach()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return gemm(self.lib, x, self.packed, self.out_features, self.bias, residual)
