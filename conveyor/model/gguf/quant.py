"""A GGUF file run in its own formats: which layers stay quantized, and building them from the memory map.

`plan_kept` decides per linear layer from the tensor types alone (no data is read); the model is
then built with placeholders for those layers (no float copy of their weights is ever made), the
float tensors are loaded as usual, and `materialize` repacks each kept tensor in C straight from the
memory-mapped file, releasing its pages from this process as it goes.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from conveyor.kernels import KernelLibrary, formats, quant
from conveyor.model.gguf.validate import SCANNED_TYPES, check_dequantized, check_finite
from conveyor.model.quant import PendingQuantLinear, QuantEmbedding, QuantLinear

logger = logging.getLogger(__name__)

# GGUF tensor types our kernels run -> their format names (kernels.h's table).
KERNEL_TYPES = {t: f.name for t, f in formats.BY_GGUF_TYPE.items()}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
REQUANTIZED = "q8_0 (requantized)"


@dataclass
class Part:
    """One file tensor of a kept layer: its format (or REQUANTIZED) and the file row of each channel."""

    tensor: object            # gguf ReaderTensor
    fmt: str
    rows: np.ndarray | None   # None: the file's order


@dataclass
class KeepPlan:
    layers: dict[str, list[Part]] = field(default_factory=dict)   # our module path -> parts in row order
    embedding: object | None = None                                # token_embd read from its blocks
    skipped: set[str] = field(default_factory=set)                 # file tensors the float loader skips


def layer_groups(arch, tensors: dict) -> dict[str, list[str]]:  # noqa: ANN001
    groups: dict[str, list[str]] = {}
    for i in range(arch.num_layers):
        fused_qkv, fused_gate_up = f"blk.{i}.attn_qkv.weight", f"blk.{i}.ffn_gate.weight" not in tensors
        groups[f"layers.{i}.self_attn.qkv_proj"] = ([fused_qkv] if fused_qkv in tensors
                                                    else [f"blk.{i}.attn_{p}.weight" for p in "qkv"])
        groups[f"layers.{i}.self_attn.o_proj"] = [f"blk.{i}.attn_output.weight"]
        groups[f"layers.{i}.mlp.gate_up_proj"] = ([f"blk.{i}.ffn_up.weight"] if fused_gate_up
                                                  else [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"])
        groups[f"layers.{i}.mlp.down_proj"] = [f"blk.{i}.ffn_down.weight"]
    groups["lm_head"] = ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    return groups


def layer_tensors(arch, tensors: dict) -> Iterator[tuple[str, list[str], list, int]]:  # noqa: ANN001
    """Each layer that could stay quantized: its module path, its tensors' names, the tensors and K. A
    layer missing a tensor is left to the float loader, which reports what is missing."""
    for module, names in layer_groups(arch, tensors).items():
        found = [tensors.get(name) for name in names]
        if all(t is not None for t in found):
            yield module, names, found, int(found[0].shape[0])   # GGUF shapes list the row length first


def plan_kept(reader, arch, row_orders: dict[str, np.ndarray]) -> KeepPlan:  # noqa: ANN001
    """Which layers of the file stay quantized. `row_orders` maps a tensor name to the file row of each
    output channel where they differ (llama's q/k)."""
    tensors = {t.name: t for t in reader.tensors}
    plan = KeepPlan()
    for module, names, found, k in layer_tensors(arch, tensors):
        types = [t.tensor_type.name for t in found]
        if all(t in FLOAT_TYPES for t in types) or k % quant.QK:
            continue
        parts = []
        for t, type_name in zip(found, types):
            fmt = KERNEL_TYPES.get(type_name)
            parts.append(Part(t, fmt if fmt and quant.can_keep(fmt, k) else REQUANTIZED, row_orders.get(t.name)))
        plan.layers[module] = parts
        plan.skipped.update(names)
    embed = tensors.get("token_embd.weight")
    if embed is not None and embed.tensor_type.name not in FLOAT_TYPES:
        plan.embedding = embed
        plan.skipped.add(embed.name)
    return plan


def place_holders(model: nn.Module, plan: KeepPlan, dtype: torch.dtype) -> None:
    """On the meta-device model: kept layers become PendingQuantLinear (bias only), a kept embedding a
    QuantEmbedding, so `to_empty` allocates nothing for their weights."""
    place_layer_holders(model, plan)
    if plan.embedding is not None:
        t = plan.embedding
        model.embed_tokens = QuantEmbedding(t.data, t.tensor_type, int(t.shape[1]), int(t.shape[0]), dtype)


def place_layer_holders(model: nn.Module, plan: KeepPlan) -> None:
    """Kept layers become PendingQuantLinear: only their biases are allocated and loaded."""
    for module_path in plan.layers:
        if module_path == "lm_head" and model.lm_head is None:
            continue   # tied: made from the embedding's blocks in materialize
        parent, name = module_parent(model, module_path)
        old = getattr(parent, name)
        setattr(parent, name, PendingQuantLinear(old.in_features, old.out_features, old.bias is not None))


def materialize(model: nn.Module, plan: KeepPlan, lib: KernelLibrary) -> None:
    """Repack every kept tensor from the file and put the quantized layers in place (after load_weights
    has filled the placeholders' biases)."""
    started = time.perf_counter()
    counts: Counter[str] = Counter()
    for module_path, parts in plan.layers.items():
        weights = [_weight(lib, part) for part in parts]
        counts.update(part.tensor.tensor_type.name if part.fmt == REQUANTIZED else part.fmt for part in parts)
        if module_path == "lm_head" and model.lm_head is None:
            model.lm_head = QuantLinear(lib, weights, None)
            continue
        parent, name = module_parent(model, module_path)
        setattr(parent, name, QuantLinear(lib, weights, getattr(parent, name).bias))
    if isinstance(model.embed_tokens, QuantEmbedding):
        model.embed_tokens.use_kernels(lib)
    kept = ", ".join(f"{fmt} x{n}" for fmt, n in sorted(counts.items()) if fmt in quant.FORMATS)
    requantized = ", ".join(f"{t} x{n}" for t, n in sorted(counts.items()) if t not in quant.FORMATS)
    # What the weights are, for the live view (each linear's format as it runs, requantized ones as q8_0).
    model.weight_formats = ", ".join(f"{fmt} x{n}" for fmt, n in sorted(counts.items()))
    logger.info("weights kept in the file's formats: %s%s; token embedding %s; repacked in %.2f s", kept or "none",
                f"; dequantized and requantized to q8_0 (no kernel for them): {requantized}" if requantized else "",
                plan.embedding.tensor_type.name + " rows read from the file" if plan.embedding is not None
                else "float", time.perf_counter() - started)


def _weight(lib: KernelLibrary, part: Part) -> quant.QuantWeight:
    import gguf

    t = part.tensor
    k, n = int(t.shape[0]), int(t.shape[1])
    raw = t.data
    check_finite([t], lib)   # its bytes are read now anyway: the repack finds them in the cache
    if part.fmt == REQUANTIZED:
        w = np.asarray(gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32).reshape(n, k)
        if t.tensor_type.name not in SCANNED_TYPES:
            check_dequantized(t.name, w)
        weight = quant.quantize_int8(torch.from_numpy(w if part.rows is None else w[part.rows]))
    else:
        weight = quant.repack(lib, part.fmt, raw, n, k, part.rows)
    release_pages(raw)
    return weight


def release_pages(raw: np.ndarray) -> None:
    """Drop this process's mapping of a tensor's pages once it is repacked, so the file does not count
    twice in its memory. Safe for any read-only file mapping: a later read faults the pages back in
    from the page cache (the token embedding's rows)."""
    mapping = getattr(raw, "_mmap", None)
    if not isinstance(mapping, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = raw.ctypes.data - np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + raw.nbytes) // page * page
    if last > first:
        try:
            mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        except (OSError, ValueError):
            pass   # only a memory figure depends on it


def module_parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    module = model
    for part in parents:
        module = getattr(module, part)
    return module, name
