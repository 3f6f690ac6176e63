"""ModelRunner: one forward per StepPlan over the paged KV cache; logits only for sampling rows."""

from __future__ import annotations

import torch

from conveyor import kernels
from conveyor.core.plan import StepPlan
from conveyor.model.llama import LlamaModel
from conveyor.runtime.batch import build_batch
from conveyor.runtime.cuda_graphs import DecodeGraphs
from conveyor.runtime.kv.cache import KVCache


def kernel_tile_size(model: LlamaModel, block_size: int, device: torch.device, attention_backend: str = "auto") -> int:
    """Queries per tile of the C attention kernel for this model, or 0 for torch's attention.

    The kernel serves a model running on the C kernels (float32 or bfloat16 on CPU) whose shape it
    takes, unless another attention backend is asked for; its KV cache must then be built with
    transposed keys.
    """
    arch = model.arch
    if device.type != "cpu" or model.kernels is None or attention_backend != "auto":
        return 0
    return kernels.attention_tile_size(arch.num_heads, arch.num_kv_heads, arch.head_dim, block_size)


def flex_block_size_ok(block_size: int) -> bool:
    """Whether FlexAttention's CUDA kernel tiles this KV block size: a power of two, at least 16."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def check_flex(kv_cache: KVCache) -> None:
    """FlexAttention's limits, as a start-up error: a float cache; on CUDA, blocks its kernel tiles."""
    if kv_cache.dtype == torch.int8:
        raise ValueError("attention_backend 'flex' reads a float KV cache: use kv_cache_dtype auto, float16, "
                         "bfloat16 or float32 with it (int8 runs on the C attention kernel)")
    size = kv_cache.block_size
    if kv_cache.tensor.device.type == "cuda" and not flex_block_size_ok(size):
        raise ValueError(f"attention_backend 'flex' on CUDA needs block_size a power of two >= 16, got {size}")


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device,
                 graphs: DecodeGraphs | None = None, attention_backend: str = "auto") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.graphs = graphs   # decode steps replayed from CUDA graphs (cuda only)
        self.kernel_tile_size = kernel_tile_size(model, kv_cache.block_size, device, attention_backend)
        if kv_cache.transposed_keys != (self.kernel_tile_size > 0):
            raise ValueError("the KV cache's key layout does not match the attention path")
        # FlexAttention views the whole cache, spare block included, as one sequence of keys.
        self.flex_cache_blocks = 0
        if attention_backend == "flex":
            check_flex(kv_cache)
            self.flex_cache_blocks = kv_cache.tensor.shape[2]

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the plan's packed batch; returns logits (S + P, V) float32: its sampling rows' in order,
        then the P positions of its rows' `num_prompt_logits`, in order."""
        with torch.inference_mode():
            logits = None if self.graphs is None else self.graphs.run(plan)
            if logits is not None:
                return logits
            batch = build_batch(plan, self.kv_cache.block_size, self.model.arch.sliding_window, self.device,
                                self.kernel_tile_size, self.flex_cache_blocks)
            return self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers,
                              batch.logits_indices)

    def close(self) -> None:
        """Nothing runs beside a one-process runner (the tensor-parallel one stops its ranks)."""
