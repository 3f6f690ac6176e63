"""A GGUF file kept in its own formats on the model's device (a CUDA GPU; the CPU in tests): which layers
stay as blocks, and moving their bytes there.

Like quant.py for the C kernels, the plan is made from the tensor types alone; the kept layers are built
as placeholders (their biases only), and `materialize` copies each kept tensor's blocks from the memory
map to the device as they are, the q/k rows reordered where the loader reorders them (whole rows of
blocks: exact). A layer with a part in a type gpu_quant.py does not take is dequantized by the float
loader, as with `--quantization none`, and start-up names those types.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch
from torch import nn

from conveyor.model.gguf.gpu_quant import GpuQuantEmbedding, GpuQuantLinear, can_keep
from conveyor.model.gguf.quant import (FLOAT_TYPES, KeepPlan, Part, layer_tensors, module_parent, place_layer_holders,
                                       release_pages)

logger = logging.getLogger(__name__)


def plan_on_device(reader, arch, row_orders: dict[str, np.ndarray]) -> KeepPlan:  # noqa: ANN001
    """Which layers keep their blocks: those whose every part is of a type gpu_quant.py dequantizes."""
    tensors = {t.name: t for t in reader.tensors}
    plan = KeepPlan()
    for module, names, found, k in layer_tensors(arch, tensors):
        if all(can_keep(t.tensor_type.name, k) for t in found):
            plan.layers[module] = [Part(t, t.tensor_type.name, row_orders.get(t.name)) for t in found]
            plan.skipped.update(names)
    embed = tensors.get("token_embd.weight")
    if embed is not None and can_keep(embed.tensor_type.name, int(embed.shape[0])):
        plan.embedding = embed
        plan.skipped.add(embed.name)
    dequantized = Counter(t.tensor_type.name for t in reader.tensors
                          if t.name not in plan.skipped and t.tensor_type.name not in FLOAT_TYPES)
    if dequantized:
        logger.info("GGUF tensors without a kept-quantized path on the device, dequantized to float: %s",
                    ", ".join(f"{name} x{n}" for name, n in sorted(dequantized.items())))
    return plan


def place_holders(model: nn.Module, plan: KeepPlan, dtype: torch.dtype, device: str) -> None:
    """On the meta-device model: kept layers become PendingQuantLinear (bias only); a kept embedding is
    built now, its blocks copied to the device."""
    place_layer_holders(model, plan)
    if plan.embedding is not None:
        t = plan.embedding
        [(_, table)] = _segments([Part(t, t.tensor_type.name, None)], device)
        model.embed_tokens = GpuQuantEmbedding(t.tensor_type.name, table, int(t.shape[0]), dtype)


def materialize(model: nn.Module, plan: KeepPlan, dtype: torch.dtype, device: str) -> None:
    """Copy every kept layer's blocks to the device and put the layers in place (after load_weights has
    filled the placeholders' biases, which take the model's dtype)."""
    started = time.perf_counter()
    counts: Counter[str] = Counter()
    embedding = model.embed_tokens if isinstance(model.embed_tokens, GpuQuantEmbedding) else None
    for module_path, parts in plan.layers.items():
        counts.update(part.fmt for part in parts)
        if embedding is not None and parts[0].tensor is plan.embedding and parts[0].rows is None:
            segments = [(parts[0].fmt, embedding.qdata)]   # a tied output layer shares the table's bytes
        else:
            segments = _segments(parts, device)
        k = int(parts[0].tensor.shape[0])
        if module_path == "lm_head" and model.lm_head is None:
            model.lm_head = GpuQuantLinear(segments, k, None)
            continue
        parent, name = module_parent(model, module_path)
        bias = getattr(parent, name).bias
        setattr(parent, name, GpuQuantLinear(segments, k, None if bias is None else bias.to(dtype)))
    model.weight_formats = ", ".join(f"{fmt.lower()} x{n}" for fmt, n in sorted(counts.items()))
    logger.info("weights kept in the file's formats on %s: %s; token embedding %s; copied in %.2f s", device,
                model.weight_formats or "none", embedding.type_name if embedding is not None else "float",
                time.perf_counter() - started)


def _segments(parts: list[Part], device: str) -> list[tuple[str, torch.Tensor]]:
    """A layer's blocks on the device, one uint8 (rows, bytes per row) tensor per run of parts of one
    type (q/k/v of one type: one matmul over their rows), rows in our order."""
    runs: list[tuple[str, list[np.ndarray]]] = []
    for part in parts:
        raw = part.tensor.data
        host = np.array(raw if part.rows is None else raw[part.rows], dtype=np.uint8)
        release_pages(raw)
        if runs and runs[-1][0] == part.fmt:
            runs[-1][1].append(host)
        else:
            runs.append((part.fmt, [host]))
    return [(fmt, torch.from_numpy(np.concatenate(hosts) if len(hosts) > 1 else hosts[0]).to(device))
            for fmt, hosts in runs]
