"""Gemma 3 (text): its own decoder layer around the shared attention and gated MLP.

Where it differs from the Llama family: a norm after attention and after the MLP as well as before
each; GELU (tanh) in the gated MLP; embeddings scaled by sqrt(hidden); per-head q/k norms; q.k scaled
by query_pre_attn_scalar; and two RoPE tables, the sliding-window layers turning with their own base
(10k) and the global layers with the model's (1M, maybe scaled). Norm weights are held as GGUF stores
them, the multiplier itself (Hugging Face stores multiplier - 1: the loader adds the 1).
"""

from __future__ import annotations


import torch
from torch import nn

from conveyor.kernels import decoder as decoder_kernel
from conveyor.model.attention import AttentionMetadata
from conveyor.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from conveyor.model.llama import Attention, LlamaModel, ModelArch, fused_params



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
        self.fused: decoder_kernel.LayerParams | None = None   # the whole layer in one C call, when set

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
        """Describe this layer to the one-call C kernel (see DecoderLayer.fuse)."""
        params = fused_params(self.input_layernorm, self.self_attn, self.pre_feedforward_layernorm, self.mlp)
        if params is None:
            return False
        self.fused = decoder_kernel.layer_params(
            *params[0], **params[1], post_attn_norm=self.post_attention_layernorm.weight,
            post_mlp_norm=self.post_feedforward_layernorm.weight, local_rope=self.is_sliding)
        return True


class Gemma3Model(LlamaModel):
    def __init__(self, arch: ModelArch, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(arch, rope_freq_factors)
        self.norm = Gemma3RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        with torch.device("cpu"):   # see LlamaModel: the tables stay real on the meta device
            self.rotary_local = RotaryEmbedding(arch.rope_dim, arch.rope_local_theta or arch.rope_theta, None)
        self.embed_scale = arch.hidden_size ** 0.5

    def make_layer(self, arch: ModelArch, index: int) -> nn.Module:
        return Gemma3DecoderLayer(arch, index)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)   # rounded to the model's dtype, as transformers
        tables = {False: self.rotary.cos_sin(positions), True: self.rotary_local.cos_sin(positions)}
        if self.fused_layers and meta.kernel is not None:
            self._fused_layers(x, *tables[False], meta, kv_caches, local=tables[True])
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                cos, sin = tables[layer.is_sliding]
                x = layer(x, cos, sin, kv_cache, meta)
        return x

