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
        # The fused kernels take float32 and bfloat16 CPU caches; anything else takes the torch path.
        self.use_kernel = (device.type == "cpu" and kv_cache.tensor.dtype in (torch.float32, torch.bfloat16)
                           and kernels.has_paged_decode())

    def execute(self, plan: StepPlan) -> tuple[Batch, torch.Tensor]:
        """Run the plan's packed batch; returns it with logits (S, V) float32 for its sampling rows."""
        batch = build_batch(plan, self.kv_cache.block_size, self.model.arch.sliding_window, self.device,
                            self.use_kernel)
        with torch.inference_mode():
            logits = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers,
                                batch.logits_indices)
        return batch, logits
