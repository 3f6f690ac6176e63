"""Tensor-parallel shards of a Llama checkpoint: which slice of every tensor a rank holds.

Megatron's split, so that each layer needs two all-reduces and nothing else:
- attention: q heads split as evenly as they go; each rank keeps the KV heads its q heads read (so KV heads are
  replicated when there are fewer than ranks); QKV is column-parallel, o_proj row-parallel;
- MLP: gate/up column-parallel, down row-parallel;
- embedding and output layer vocabulary-parallel (rows split; the last shard padded with zeros).
Row-parallel biases are kept by rank 0 only, so the all-reduce adds them once. Pure functions of
(name, tensor, arch, shard): the loader streams a checkpoint through them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from conveyor.model.llama import ModelArch


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where a rank's slices sit in the full model."""

    q_heads: range                 # global q heads
    kv_heads: tuple[int, ...]      # global KV head of each local KV head (repeats when expanded)
    intermediate: range
    vocab: range                   # global token ids of local embedding rows (the padding rows excluded)
    vocab_rows: int                # local embedding rows, padding included (the same on every rank)


def layout(arch: ModelArch, shard: Shard) -> ShardLayout:
    world, rank = shard.world_size, shard.rank
    heads, kv_heads = arch.num_heads, arch.num_kv_heads
    if heads < world or arch.intermediate_size < world:
        raise ValueError(f"tensor parallel size {world} exceeds the attention heads ({heads}) or the MLP width "
                         f"({arch.intermediate_size})")
    # Heads and MLP columns as evenly as they go (9 heads over 2 ranks: 4 and 5).
    q_heads = range(rank * heads // world, (rank + 1) * heads // world)
    local_heads = len(q_heads)
    group = heads // kv_heads
    needed = sorted({q // group for q in q_heads})
    # Local q head i reads local KV head i // (local_heads // len(needed)) when that is the right one;
    # otherwise each q head gets its own copy of the KV head it reads.
    per_kv = local_heads // len(needed)
    if local_heads % len(needed) or any(needed[i // per_kv] != q // group for i, q in enumerate(q_heads)):
        needed = [q // group for q in q_heads]
    width = arch.intermediate_size
    intermediate = range(rank * width // world, (rank + 1) * width // world)
    vocab_rows = -(-arch.vocab_size // world)
    vocab = range(rank * vocab_rows, min((rank + 1) * vocab_rows, arch.vocab_size))
    return ShardLayout(q_heads, tuple(needed), intermediate, vocab, vocab_rows)


def local_arch(arch: ModelArch, shard: Shard) -> ModelArch:
    lay = layout(arch, shard)
    return dataclasses.replace(arch, num_heads=len(lay.q_heads), num_kv_heads=len(lay.kv_heads),
                               intermediate_size=len(lay.intermediate), vocab_size=lay.vocab_rows)


def shard_tensor(name: str, tensor: torch.Tensor, arch: ModelArch, shard: Shard) -> torch.Tensor:
    """This rank's slice of a Hugging Face-named checkpoint tensor."""
    lay = layout(arch, shard)
    d = arch.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return tensor[lay.q_heads.start * d: lay.q_heads.stop * d]
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        heads = tensor.view(arch.num_kv_heads, d, *tensor.shape[1:])
        return heads[list(lay.kv_heads)].reshape(len(lay.kv_heads) * d, *tensor.shape[1:])
    if name.endswith("o_proj.weight"):
        return tensor[:, lay.q_heads.start * d: lay.q_heads.stop * d]
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
        return tensor[lay.intermediate.start: lay.intermediate.stop]
    if name.endswith("down_proj.weight"):
        return tensor[:, lay.intermediate.start: lay.intermediate.stop]
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = tensor[lay.vocab.start: lay.vocab.stop]
        if len(rows) < lay.vocab_rows:
            rows = torch.cat([rows, rows.new_zeros(lay.vocab_rows - len(rows), *rows.shape[1:])])
        return rows
    return tensor   # norms: every rank holds them whole
