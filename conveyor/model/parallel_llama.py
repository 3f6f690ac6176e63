"""One rank's part of a tensor-parallel Llama: the model/sharding.py slices, joined by collectives.

Each layer's attention and MLP produce partial sums of the hidden state on every rank (their last
matmul is row-parallel); one all-reduce per block adds them, in float32 so that bfloat16 ranks lose
nothing in the sum. The embedding is vocabulary-parallel (a rank looks up only its own ids, the
all-reduce fills in the rest) and so is the output layer (its logit columns are gathered).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F

from conveyor.kernels import KernelLibrary
from conveyor.model.attention import AttentionMetadata
from conveyor.model.llama import LlamaModel, ModelArch


class Collectives(Protocol):
    """What a rank needs from its process group."""

    world_size: int

    def all_reduce_(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class ParallelLlamaModel(LlamaModel):
    def __init__(self, arch: ModelArch, full_vocab_size: int, vocab_start: int, comm: Collectives,
                 rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(arch, rope_freq_factors)   # arch: this rank's (local heads, MLP width, vocab rows)
        self.full_vocab_size = full_vocab_size
        self.vocab_start = vocab_start
        self.comm = comm

    @property
    def vocab_size(self) -> int:
        return self.full_vocab_size

    def use_kernels(self, lib: KernelLibrary, fuse: bool = False) -> None:
        # The fused one-call layer has no place for the all-reduce between attention and MLP; the
        # layers run module by module (packed matmuls, and the C attention kernel: `kernels` set
        # makes the runner plan for it). This forward never takes LlamaModel's fused path.
        super().use_kernels(lib, fuse=False)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        total = partial.float()
        self.comm.all_reduce_(total)
        return total.to(partial.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.vocab_start
        mine = (local_ids >= 0) & (local_ids < self.arch.vocab_size)
        weight = self.embed_tokens.weight
        x = self._reduce(F.embedding(local_ids.clamp(0, self.arch.vocab_size - 1), weight) * mine[:, None])
        cos, sin = self.rotary.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = x + self._reduce(layer.self_attn(layer.input_layernorm(x), cos, sin, kv_cache, meta))
            x = x + self._reduce(layer.mlp(layer.post_attention_layernorm(x)))
        x = self.norm(x[logits_indices])
        local = x @ weight.t() if self.lm_head is None else self.lm_head(x)    # (S, vocab rows of this rank)
        return torch.cat(self.comm.all_gather(local.float().contiguous()), dim=-1)[:, : self.full_vocab_size]
