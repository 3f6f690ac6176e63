"""ModelRunner: one forward per StepPlan over the paged KV cache; logits only for sampling rows."""

from __future__ import annotations

import torch

from conveyor import kernels
from conveyor.core.plan import StepPlan
from conveyor.model.llama import LlamaModel
from conveyor.runtime.batch import Batch, build_batch
from conveyor.runtime.kv_cache import KVCache


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # The attention kernel takes float32 and bfloat16 CPU caches of a model running on the kernels;
        # anything else takes the torch path.
        arch = model.arch
        uses_kernels = model.layers[0].self_attn.kernels is not None
        self.kernel_tile_size = (
            kernels.attention_tile_size(arch.num_heads, arch.num_kv_heads, arch.head_dim, kv_cache.block_size)
            if uses_kernels and device.type == "cpu" and kv_cache.tensor.dtype in (torch.float32, torch.bfloat16)
            else 0)

    def execute(self, plan: StepPlan) -> tuple[Batch, torch.Tensor]:
        """Run the plan's packed batch; returns it with logits (S, V) float32 for its sampling rows."""
        batch = build_batch(plan, self.kv_cache.block_size, self.model.arch.sliding_window, self.device,
                            self.kernel_tile_size)
        with torch.inference_mode():
            logits = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers,
                                batch.logits_indices)
        return batch, logits
