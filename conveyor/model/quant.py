"""Linear layers and embeddings on weights kept quantized: `--quantization auto | none | int8 | gguf`.

- auto (the default): a GGUF file runs in its own formats. Every linear layer whose tensors are
  Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K or Q6_K stays in that format (repacked in C, losslessly; the
  parts of a fused q/k/v or gate/up keep their own formats as segments of one layer); tensors of
  another quantized type are dequantized once and requantized to Q8_0 (float types stay float); the
  token embedding stays in the file's blocks and only the looked-up rows are dequantized. Hugging
  Face folders, tensor parallelism or an explicit non-float32 dtype resolve auto to none. On a CUDA
  GPU the layers of Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K tensors and the token table keep the
  file's blocks on the device in torch's layers instead (gguf/gpu_quant.py), with any dtype; other
  layers are dequantized to it.
- none: weights as loaded, in the model's dtype (GGUF tensors dequantized to float).
- int8: every linear layer (and the output layer, tied or not) whose K is a multiple of 32 is
  quantized to symmetric int8 in blocks of 32 along K (Q8_0's layout), from the float weights.
- gguf: auto, for a GGUF file only (an error for a folder).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from conveyor.config import QUANTIZATIONS
from conveyor.kernels import KernelLibrary
from conveyor.kernels import quant
from conveyor.kernels.quant import QuantWeight

logger = logging.getLogger(__name__)


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W kept quantized, as segments along N each in its own format; float32
    in and out. The activations are quantized once for all segments (kernels/kquant.c)."""

    def __init__(self, lib: KernelLibrary, weights: list[QuantWeight], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib = lib
        self.weights = list(weights)
        self.in_features, self.out_features = weights[0].k, sum(w.n for w in weights)
        for i, w in enumerate(self.weights):
            self.register_buffer(f"qdata{i}", w.data)   # counted by model.buffers() for memory reports
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.spec = quant.linear_spec(self.weights, self.bias)   # raw pointers: the tensors above own them

    @property
    def weight(self) -> QuantWeight:
        """The weight of a one-segment layer."""
        if len(self.weights) != 1:
            raise AttributeError("a layer of several segments has no single weight")
        return self.weights[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant.run_linear(self.lib, x, self.spec, self.out_features)

    def extra_repr(self) -> str:
        formats = "+".join(w.fmt for w in self.weights)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"


class PendingQuantLinear(nn.Module):
    """Stands in for a linear layer whose weight will be repacked from the file: only its bias (if any)
    is a parameter, so building the model allocates no float copy of the weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None


class QuantEmbedding(nn.Module):
    """Token embedding read from the file's blocks (a memory map): a lookup dequantizes only its rows."""

    def __init__(self, raw: np.ndarray, tensor_type, num_embeddings: int, embedding_dim: int,  # noqa: ANN001
                 dtype: torch.dtype) -> None:
        super().__init__()
        import gguf

        self.raw, self.tensor_type, self.dtype = raw, tensor_type, dtype
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._table = raw.view(np.ndarray)
        # The format's own rows -> float32, without gguf.quants.dequantize's per-call splitting and checks
        # (most of a decode step's lookup); gguf's public entry point where that class is not found.
        traits = getattr(gguf.quants, "_type_traits", {}).get(tensor_type)
        self._dequantize_rows = (traits.dequantize_rows if traits is not None
                                 else lambda rows: gguf.quants.dequantize(rows, tensor_type))
        self._lib: KernelLibrary | None = None   # set by use_kernels for the formats embed.c reads

    def use_kernels(self, lib: KernelLibrary) -> None:
        """Look rows up in C (one call, the same values) when the table's format is one embed.c reads."""
        if self.tensor_type.name.lower() in quant.EMBED_FORMATS and self.embedding_dim % quant.QK == 0:
            self._lib, self._address = lib, self._table.ctypes.data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._lib is not None and input_ids.device.type == "cpu":
            table = self._table
            x = quant.embed_rows(self._lib, self.tensor_type.name.lower(), self._address, table.shape[0],
                                 table.shape[1], input_ids, self.embedding_dim)
            return x if self.dtype == torch.float32 else x.to(self.dtype)
        rows = self._table[input_ids.numpy() if input_ids.device.type == "cpu" else input_ids.cpu().numpy()]
        x = np.asarray(self._dequantize_rows(rows), dtype=np.float32)
        return torch.from_numpy(x.reshape(-1, self.embedding_dim)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.tensor_type.name}"


def quantize_linears(model: nn.Module, lib: KernelLibrary, quantization: str) -> int:
    """int8: swap every float linear layer (and a tied output layer) for an int8 QuantLinear in place,
    before `use_kernels`. Returns the number of layers swapped."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization != "int8":
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % quant.QK == 0:
                setattr(module, name, QuantLinear(lib, [quant.quantize_int8(child.weight)], child.bias))
                swapped += 1
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", 1) is None and isinstance(embed, nn.Embedding) \
            and embed.weight.shape[1] % quant.QK == 0:
        # Tied: the embedding keeps its float table for lookups; the output layer gets its own.
        model.lm_head = QuantLinear(lib, [quant.quantize_int8(embed.weight)], None)
        swapped += 1
    logger.info("quantization int8: %d linear layers kept quantized", swapped)
    return swapped
