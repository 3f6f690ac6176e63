"""Linear layers on weights kept quantized: `--quantization none | int8 | gguf`.

- none: weights as loaded, in the model's dtype (GGUF tensors are dequantized to float).
- int8: every linear layer (and the output layer, tied or not) whose K is a multiple of 32 is
  quantized to symmetric int8 in blocks of 32 along K (Q8_0's layout), from whatever the
  checkpoint holds.
- gguf: the GGUF file's Q8_0 / Q4_0 / Q4_1 tensors are kept in their own format (repacked
  losslessly); a layer whose tensors are float or of another type stays float. A tied output layer
  reuses the quantized embedding table. Only for GGUF files.

The embedding lookup always keeps a float table (a gather reads only T rows of it).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from conveyor.config import QUANTIZATIONS
from conveyor.kernels import KernelLibrary
from conveyor.kernels import quant
from conveyor.kernels.quant import QuantWeight

logger = logging.getLogger(__name__)


# Our fused linear -> the Hugging Face names of its parts, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W kept quantized (kernels/quant.py); float32 in and out."""

    def __init__(self, lib: KernelLibrary, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib = lib
        self.weight = weight
        self.out_features, self.in_features = weight.n, weight.k
        self.register_buffer("qdata", weight.data)   # counted by model.buffers() for memory reports
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant.gemm(self.lib, x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.weight.fmt}"


def quantize_linears(model: nn.Module, lib: KernelLibrary, quantization: str,
                     gguf_weights: dict[str, QuantWeight] | None = None) -> int:
    """Swap linear layers for QuantLinear in place (before `pack_linears`, which packs the rest).

    `gguf_weights` maps Hugging Face tensor names ("model.layers.0.mlp.up_proj.weight") to the
    file's blocks, for quantization "gguf". Returns the number of layers swapped.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return 0
    swapped = 0
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child.in_features % quant.QK:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if quantization == "int8":
                weight = quant.quantize_int8(child.weight)
            else:
                weight = _from_file(full, gguf_weights or {})
            if weight is not None:
                setattr(module, name, QuantLinear(lib, weight, child.bias))
                swapped += 1
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", 1) is None and embed is not None and embed.weight.shape[1] % quant.QK == 0:
        # Tied: the embedding keeps its float table for lookups; the output layer gets its own.
        if quantization == "int8":
            weight = quant.quantize_int8(embed.weight)
        else:
            weight = (gguf_weights or {}).get("model.embed_tokens.weight")
        if weight is not None:
            model.lm_head = QuantLinear(lib, weight, None)
            swapped += 1
    logger.info("quantization %s: %d linear layers kept quantized", quantization, swapped)
    return swapped


def _from_file(module_name: str, weights: dict[str, QuantWeight]) -> QuantWeight | None:
    """The file's blocks for one of our linears (fused parts stacked), or None to stay float."""
    hf = module_name if module_name == "lm_head" else f"model.{module_name}"
    for ours, parts in _FUSED.items():
        if hf.endswith(ours):
            names = [hf.removesuffix(ours) + part + ".weight" for part in parts]
            found = [weights.get(n) for n in names]
            if any(w is None for w in found) or len({w.fmt for w in found}) != 1:
                return None   # float or mixed formats: one kernel call needs one format
            return quant.concat_rows(found)
    return weights.get(hf + ".weight")
