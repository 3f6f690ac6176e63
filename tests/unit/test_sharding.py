"""Which slice of a checkpoint each tensor-parallel rank holds (pure functions, no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.model.llama import ModelArch
from conveyor.model.sharding import Shard, layout, local_arch, shard_tensor

ARCH = ModelArch(architecture="LlamaForCausalLM", vocab_size=11, hidden_size=8, intermediate_size=6, num_layers=1,
                 num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                 max_position_embeddings=64, tie_word_embeddings=True)


def kv_heads(num_heads: int, num_kv_heads: int, world: int) -> list[tuple[int, ...]]:
    arch = dataclasses.replace(ARCH, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return [layout(arch, Shard(rank, world)).kv_heads for rank in range(world)]


def test_kv_heads_split_evenly_are_replicated_when_few_and_copied_when_uneven() -> None:
    assert kv_heads(4, 2, 2) == [(0,), (1,)]                 # an even split
    assert kv_heads(8, 4, 2) == [(0, 1), (2, 3)]
    assert kv_heads(4, 1, 2) == [(0,), (0,)]                 # fewer KV heads than ranks: each keeps it
    assert kv_heads(6, 3, 2) == [(0, 0, 1), (1, 2, 2)]       # uneven: one copy per q head
    assert kv_heads(4, 4, 2) == [(0, 1), (2, 3)]
    assert kv_heads(9, 3, 2) == [(0, 0, 0, 1), (1, 1, 2, 2, 2)]   # SmolLM2's 9 heads: 4 and 5


def test_slices_reassemble_the_full_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(ARCH.num_heads * ARCH.head_dim, ARCH.hidden_size, generator=g)
    o = torch.randn(ARCH.hidden_size, ARCH.num_heads * ARCH.head_dim, generator=g)
    down = torch.randn(ARCH.hidden_size, ARCH.intermediate_size, generator=g)
    embed = torch.randn(ARCH.vocab_size, ARCH.hidden_size, generator=g)
    shards = [Shard(0, 2), Shard(1, 2)]
    name = "model.layers.0.self_attn."
    assert torch.equal(torch.cat([shard_tensor(name + "q_proj.weight", q, ARCH, s) for s in shards]), q)
    assert torch.equal(torch.cat([shard_tensor(name + "o_proj.weight", o, ARCH, s) for s in shards], 1), o)
    assert torch.equal(torch.cat([shard_tensor("model.layers.0.mlp.down_proj.weight", down, ARCH, s)
                                  for s in shards], 1), down)
    rows = [shard_tensor("model.embed_tokens.weight", embed, ARCH, s) for s in shards]
    assert [len(r) for r in rows] == [6, 6] and torch.equal(rows[1][5], torch.zeros(ARCH.hidden_size))
    assert torch.equal(torch.cat(rows)[: ARCH.vocab_size], embed)
    bias = torch.ones(ARCH.hidden_size)   # row-parallel: added once, by rank 0
    assert [shard_tensor(name + "o_proj.bias", bias, ARCH, s).sum().item() for s in shards] == [8.0, 0.0]
    assert local_arch(ARCH, shards[1]) == dataclasses.replace(ARCH, num_heads=2, num_kv_heads=1,
                                                                intermediate_size=3, vocab_size=6)


def test_more_ranks_than_heads_are_refused() -> None:
    assert [len(layout(ARCH, Shard(rank, 3)).intermediate) for rank in range(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="exceeds the attention heads"):
        layout(ARCH, Shard(0, 5))
