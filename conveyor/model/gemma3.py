"""Gemma 3 (text): its own decoder layer around the shared attention and gated MLP.

Where it differs from the Llama family: a norm after attention and after the MLP as well as before
each; GELU (tanh) in the gated MLP; embeddings scaled by sqrt(hidden); per-head q/k norms; q.k scaled
by query_pre_attn_scalar; and two RoPE tables, the sliding-window layers turning with their own base
(10k) and the global layers with the model's (1M, maybe scaled). Norm weights are held as GGUF stores
them, the multiplier itself (Hugging Face stores multiplier - 1: the loader adds the 1).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from conveyor.kernels import KernelLibrary
from conveyor.model.attention import AttentionMetadata
from conveyor.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from conveyor.model.llama import Attention, LlamaModel, ModelArch

logger = logging.getLogger(__name__)


class Gemma3RMSNorm(RMSNorm):
    """Gemma scales in float32 and casts once, (x * w).to(dtype), where Llama casts first: x.to(dtype) * w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None or x.dtype == torch.float32:
            return super().forward(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(hidden, eps)
        self.self_attn = Attention(arch, layer_index)
        self.self_attn.q_norm = Gemma3RMSNorm(arch.head_dim, eps)
        self.self_attn.k_norm = Gemma3RMSNorm(arch.head_dim, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, arch.intermediate_size, arch.mlp_bias, arch.hidden_act)
        self.post_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)

    @property
    def is_sliding(self) -> bool:
        return self.self_attn.window is not None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)

    def fuse(self) -> bool:
        return False   # the one-call C layer is Llama's: no norms after attention and MLP, no GELU


class Gemma3Model(LlamaModel):
    def __init__(self, arch: ModelArch, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(arch, rope_freq_factors)
        self.norm = Gemma3RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        with torch.device("cpu"):   # see LlamaModel: the tables stay real on the meta device
            self.rotary_local = RotaryEmbedding(arch.rope_dim, arch.rope_local_theta or arch.rope_theta, None)
        self.embed_scale = arch.hidden_size ** 0.5

    def make_layer(self, arch: ModelArch, index: int) -> nn.Module:
        return Gemma3DecoderLayer(arch, index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)   # rounded to the model's dtype, as transformers
        tables = {False: self.rotary.cos_sin(positions), True: self.rotary_local.cos_sin(positions)}
        for layer, kv_cache in zip(self.layers, kv_caches):
            cos, sin = tables[layer.is_sliding]
            x = layer(x, cos, sin, kv_cache, meta)
        x = self.norm(x[logits_indices])
        logits = x @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(x)
        return logits.float()

    def use_kernels(self, lib: KernelLibrary, fuse: bool = True) -> None:
        super().use_kernels(lib, fuse=False)
        if self.kernels is not None:
            logger.info("Gemma 3 decoder layers run op by op on the C kernels (the one-call layer is Llama's)")
