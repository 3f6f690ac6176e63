"""The Llama decoder family (Llama, Mistral, Qwen2, Qwen3, Phi-3), selected by config flags, run on packed batches."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels import KernelLibrary, triton_layer
from conveyor.kernels import decoder as decoder_kernel
from conveyor.kernels.gemm import DTYPES as KERNEL_DTYPES
from conveyor.kernels.gemm import can_pack
from conveyor.model.attention import AttentionMetadata, paged_attention
from conveyor.model.layers import (Embedding, GatedMLP, Linear, PackedLinear, RMSNorm, RotaryEmbedding, apply_rotary,
                                   linear_residual)
from conveyor.model.quant import QuantLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelArch:
    """Shape and numerics of a checkpoint, independent of the file format it came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()   # per layer: does the sliding window apply
    qk_norm: bool = False                   # RMSNorm over each head of q and k before RoPE (Qwen3)
    rotary_dim: int | None = None           # leading dims of each head that RoPE turns; None: all (Phi-4-mini: 3/4)
    family: str = "llama"                   # "gemma3": its own decoder layer (model/gemma3.py)
    attn_scale: float | None = None         # multiplier of q.k; None: head_dim ** -0.5
    rope_local_theta: float | None = None   # RoPE base of the sliding-window layers, where it differs (Gemma 3)
    hidden_act: str = "silu"                # the gated MLP's activation: silu or gelu_tanh

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token at one byte per element; multiply by the element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.scale = arch.attn_scale if arch.attn_scale is not None else self.head_dim ** -0.5
        is_sliding = bool(arch.sliding_layers and arch.sliding_layers[layer_index])
        self.window = arch.sliding_window if is_sliding else None
        self.rope_dim = arch.rope_dim
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj(attention(x)), plus `residual` when given (which may be overwritten with the sum)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)                                             # (T, (H + 2KV) * D)
        # q and k are adjacent in qkv: rotate them in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)   # (T, H + KV, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, -1, self.head_dim),
                            self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, -1, self.head_dim)], dim=1)
        if self.rope_dim == self.head_dim and cos.dtype == qk.dtype and triton_layer.available(qk):
            qk = triton_layer.rotary_(qk, cos, sin)   # apply_rotary's arithmetic in one kernel, in place
        elif self.rope_dim == self.head_dim:
            qk = apply_rotary(qk, cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype))
        else:   # partial rotary: the leading rope_dim of each head turn, the rest pass as they are
            cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
            qk = torch.cat([apply_rotary(qk[..., : self.rope_dim], cos, sin), qk[..., self.rope_dim:]], dim=-1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)       # (T, H, D), (T, KV, D)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        return linear_residual(self.o_proj, out.view(num_tokens, self.q_size), residual)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, arch.hidden_act)
        self.fused: decoder_kernel.LayerParams | None = None   # the whole layer in one C call, when set

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def fuse(self) -> bool:
        """Describe this layer to the one-call C kernel; False if a part of it cannot run there."""
        attn, mlp = self.self_attn, self.mlp
        params = fused_params(self.input_layernorm, attn, self.post_attention_layernorm, mlp)
        if params is None:
            return False
        self.fused = decoder_kernel.layer_params(*params[0], **params[1])
        return True


def fused_params(ln1: RMSNorm, attn: Attention, ln2: RMSNorm, mlp: GatedMLP) -> tuple[tuple, dict] | None:
    """layer_params' arguments for a layer's shared parts, or None where the one-call layer cannot run it
    (a linear neither packed nor quantized; quantized weights with bfloat16 activations)."""
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    quantized = [isinstance(m, QuantLinear) for m in linears]
    if not all(isinstance(m, PackedLinear) or q for m, q in zip(linears, quantized)):
        return None
    if any(quantized) and ln1.weight.dtype != torch.float32:
        return None   # the quantized matmul takes float32 activations
    norms = {} if attn.q_norm is None else {"q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight}
    return ((ln1.weight, attn.qkv_proj, attn.o_proj, ln2.weight, mlp.gate_up_proj, mlp.down_proj),
            dict(eps=ln1.eps, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                 rope_dim=attn.rope_dim, window=attn.window, scale=attn.scale, activation=mlp.activation, **norms))


class LlamaModel(nn.Module):
    """Decoder over a packed batch: (T,) token ids in, logits for the sampling rows out."""

    def __init__(self, arch: ModelArch, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head: nn.Module | None = (None if arch.tie_word_embeddings
                                          else Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.kernels: KernelLibrary | None = None   # set by use_kernels: linears, norms, attention in C
        self.fused_layers = False                     # every decoder layer as one C call (use_kernels)
        self._layer_array = None                      # the layers' fused params as one C array (use_kernels)
        self._cache_pointers: tuple[list, tuple] | None = None   # (the KV cache list, its C pointer arrays)
        self._head_params: tuple | None = None   # (the output layer, the final norm's weight, their C params)
        with torch.device("cpu"):  # the model may be built on the meta device; RoPE tables stay real
            self.rotary = RotaryEmbedding(arch.rope_dim, arch.rope_theta, arch.rope_scaling, rope_freq_factors)

    def make_layer(self, arch: ModelArch, index: int) -> nn.Module:
        return DecoderLayer(arch, index)

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (a tensor-parallel shard's arch counts only its own rows)."""
        return self.arch.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,); logits_indices: (S,) rows to sample. Returns (S, V) float32."""
        head = self._fused_head() if self.fused_layers and meta.kernel is not None else None
        if head is None:
            x = self.hidden_states(input_ids, positions, meta, kv_caches)
        else:   # hidden_states' fused path, with the head in the same C call where it can run there
            x = self.embed_tokens(input_ids)
            cos, sin = self.rotary.tables(meta.kernel.max_context)   # rows looked up in C by position
            if head.format < 0 or x.dtype == torch.float32:   # a quantized head takes float32 activations
                logits = torch.empty(logits_indices.shape[0], head.vocab,
                                     dtype=torch.float32 if head.format >= 0 else x.dtype)
                rows = logits_indices.to(torch.int64).contiguous()
                self._fused_layers(x, cos, sin, meta, kv_caches, head=(head, rows, logits), positions=positions)
                return logits.float()
            self._fused_layers(x, cos, sin, meta, kv_caches, positions=positions)
        # One token sampled of one: its row is the only one (a one-row decode step skips the gather).
        return self.compute_logits(x if x.shape[0] == 1 == logits_indices.shape[0] else x[logits_indices])

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(T, hidden): every token through every decoder layer, before the final norm."""
        x = self.embed_tokens(input_ids)                                   # (T, hidden), a fresh tensor
        if self.fused_layers and meta.kernel is not None:
            cos, sin = self.rotary.tables(meta.kernel.max_context)        # rows looked up in C by position
            self._fused_layers(x, cos, sin, meta, kv_caches, positions=positions)
        else:
            cos, sin = self.rotary.cos_sin(positions)                      # (T, D) float32 each
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)   # once, not in every layer
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(S, hidden) of the rows to sample -> (S, V) float32: the final norm and the output layer."""
        x = self.norm(x)
        logits = x @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(x)
        return logits.float()

    def _fused_head(self) -> decoder_kernel.HeadParams | None:
        """The final norm and output layer as decoder_step takes them, where this model's own hidden_states
        and compute_logits are the base ones and both parts run on the C kernels; else None."""
        head, norm = self.lm_head, self.norm.weight
        if self._head_params is None or self._head_params[0] is not head or self._head_params[1] is not norm:
            plain = (type(self).hidden_states is LlamaModel.hidden_states
                     and type(self).compute_logits is LlamaModel.compute_logits)
            ok = (plain and type(self.norm) is RMSNorm and self.norm.kernels is not None
                  and (hasattr(head, "packed") or hasattr(head, "spec")))
            self._head_params = (head, norm, decoder_kernel.head_params(norm, self.norm.eps, head) if ok else None)
        return self._head_params[2]

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      local: tuple[torch.Tensor, torch.Tensor] | None = None,
                      head: tuple[decoder_kernel.HeadParams, torch.Tensor, torch.Tensor] | None = None,
                      positions: torch.Tensor | None = None) -> None:
        """Every layer in one C call, updating x in place; `local`: a second RoPE table (cos, sin); `head`:
        (its params, the rows to score, their logits' tensor) to run the head in the same call; `positions`:
        cos, sin (and local's) are whole tables, whose rows the C code looks up by these positions."""
        num_tokens = x.shape[0]
        if positions is not None and (positions.dtype != torch.int64 or not positions.is_contiguous()):
            positions = positions.to(torch.int64).contiguous()
        first = self.layers[0].fused
        scratch = torch.empty(decoder_kernel.scratch_elements(first, num_tokens), dtype=x.dtype)
        step = decoder_kernel.step_params(num_tokens, cos, sin, meta.slot_mapping, meta.kernel,
                                          kv_caches[0][1].shape[1], x.dtype == torch.bfloat16, local,
                                          kv_caches[0][0].dtype, positions)
        if self._cache_pointers is None or self._cache_pointers[0] is not kv_caches:
            # The runner passes the same list of cache tensors every step: their pointers are read once.
            self._cache_pointers = (kv_caches, decoder_kernel.cache_pointers(kv_caches))
        if head is None:
            decoder_kernel.run_layers(self.kernels, x, self._layer_array, step, self._cache_pointers[1], scratch)
        else:
            decoder_kernel.run_step(self.kernels, x, self._layer_array, step, self._cache_pointers[1], scratch, *head)

    def use_kernels(self, lib: KernelLibrary, fuse: bool = True) -> None:
        """Run on the C kernels: packed matmuls for every linear layer (and a tied output layer), and each
        decoder layer as one C call when all of it can run there. Call after load_weights; float32 and
        bfloat16 only. The C layers need the attention kernel's metadata (`meta.kernel`) to run."""
        if self.norm.weight.dtype not in KERNEL_DTYPES:
            return
        for module in list(self.modules()):
            if isinstance(module, RMSNorm):
                module.kernels = lib
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and can_pack(child.weight):
                    setattr(module, name, PackedLinear(lib, child.weight, child.bias))
        if self.lm_head is None and isinstance(self.embed_tokens, nn.Embedding) and can_pack(self.embed_tokens.weight):
            # The embedding keeps its own table for lookups; the packed copy serves the logits.
            self.lm_head = PackedLinear(lib, self.embed_tokens.weight, None)
        self.kernels = lib   # the runner plans for the C attention kernel
        self.fused_layers = fuse and all([layer.fuse() for layer in self.layers])
        self._layer_array = (decoder_kernel.layer_array([layer.fused for layer in self.layers])
                             if self.fused_layers else None)
        if fuse and not self.fused_layers:
            logger.info("decoder layers run op by op on the C kernels (the one-call layer does not cover "
                        "every layer's parts)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        arch = self.arch
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        fused = {  # HF name suffix -> (our suffix, row offset)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", arch.intermediate_size),
        }
        missing = {name: param.numel() for name, param in params.items()}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("rotary_emb") or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            target, offset = name, None
            for hf, (ours, row) in fused.items():
                if f".{hf}." in name:
                    target, offset = name.replace(hf, ours), row
                    break
            if target not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            param = params[target]
            dest = param.data if offset is None else param.data[offset: offset + tensor.shape[0]]
            if dest.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            missing[target] -= tensor.numel()
        unset = [name for name, left in missing.items() if left != 0]
        if unset:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(unset[:5])}"
                             + (f" and {len(unset) - 5} more" if len(unset) > 5 else ""))
