"""The paged KV cache: per layer, K and V tensors of fixed-size blocks, addressed by slot."""

from __future__ import annotations

import math
import mmap

import torch

from conveyor.model import kv_quant
from conveyor.model.llama import ModelArch


class KVCache:
    """K and V for every layer: (num_blocks, block_size, num_kv_heads, head_dim) each, or for the C
    attention kernel (`transposed_keys`) K as (num_blocks, num_kv_heads, head_dim, block_size), so that
    a chunk of keys loads as vectors with one key per lane.

    slot = block_id * block_size + offset; the block manager decides which blocks a request owns.
    With `spare_block`, one block more than `num_blocks` is allocated (id `num_blocks`), which no request
    ever owns: padding rows of a CUDA graph write there.

    An int8 cache (kv_quant.py) is one int8 tensor (num_layers, 2, blocks, block_bytes) whose blocks hold
    codes and their scales; `layers` then hold the code views, which the attention finds the scales beside.
    Either way `tensor[:, :, block_id]` is all of one block, which is what moves to disk and back.
    """

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", transposed_keys: bool = False, spare_block: bool = False) -> None:
        allocated = num_blocks + spare_block
        self.num_blocks, self.block_size, self.transposed_keys = num_blocks, block_size, transposed_keys
        self.spare_block: int | None = num_blocks if spare_block else None
        self.dtype = dtype
        if dtype == torch.int8:
            nbytes = kv_quant.block_bytes(block_size, arch.num_kv_heads, arch.head_dim)
            self.tensor = _zeros((arch.num_layers, 2, allocated, nbytes), dtype, torch.device(device))
            self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
                kv_quant.code_views(self.tensor[i], block_size, arch.num_kv_heads, arch.head_dim, transposed_keys)
                for i in range(arch.num_layers)]
            return
        shape = (arch.num_layers, 2, allocated, block_size, arch.num_kv_heads, arch.head_dim)
        self.tensor = _zeros(shape, dtype, torch.device(device))
        k_shape = (allocated, arch.num_kv_heads, arch.head_dim, block_size) if transposed_keys else shape[2:]
        self.layers = [(self.tensor[i, 0].view(k_shape), self.tensor[i, 1]) for i in range(arch.num_layers)]

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
        """Every layer's K and V of one block, scales included."""
        if dtype == torch.int8:
            return arch.num_layers * 2 * kv_quant.block_bytes(block_size, arch.num_kv_heads, arch.head_dim)
        return arch.kv_bytes_per_token * block_size * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def num_blocks_for(cls, arch: ModelArch, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
        return memory_bytes // cls.bytes_per_block(arch, block_size, dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU it lives in an anonymous mapping, which the OS hands out as zero
    pages on first touch: writing gigabytes of zeros at start-up took seconds, and memory is only
    committed for the blocks used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)   # the tensor keeps the mapping alive
    if hasattr(mmap, "MADV_HUGEPAGE"):   # fewer page faults and TLB misses where the kernel allows it
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def working_reserve(arch: ModelArch, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """GPU memory a step may take beside weights and KV cache: 1 GiB for the graphs' pool and the
    allocator's slack, the widest activations of the largest step (the MLP's gate and up in float32),
    and the sampled rows' logits with the sampler's working copy."""
    mlp = max_num_batched_tokens * arch.intermediate_size * 2 * 4
    logits = max_num_seqs * arch.vocab_size * 4 * 3
    return 2**30 + mlp + logits


def gpu_kv_budget(free_bytes: int, total_bytes: int, utilization: float, reserve_bytes: int) -> int:
    """Bytes for the KV cache: `utilization` of the card, less what is already held on it (the weights,
    any other process) and the working reserve. May be zero or negative: nothing is left."""
    return int(total_bytes * utilization) - (total_bytes - free_bytes) - reserve_bytes
