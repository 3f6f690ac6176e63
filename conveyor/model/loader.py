"""Checkpoints on disk (a GGUF file or a Hugging Face folder) -> our LlamaModel with its weights.

The tokenizer is not loaded here (see text/tokenizer.py). Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from conveyor.config import QUANTIZATIONS
from conveyor.errors import ModelLoadError
from conveyor.kernels import KernelLibrary
from conveyor.model.gguf import device_keep
from conveyor.model.gguf import quant as gguf_quant
from conveyor.model.families import model_class
from conveyor.model.gguf.model import arch_from_gguf, open_gguf, open_gguf_reader
from conveyor.model.hf_folder import arch_from_hf_config, open_hf_folder, read_hf_config
from conveyor.model.layers import RotaryEmbedding
from conveyor.model.llama import LlamaModel, ModelArch
from conveyor.model.parallel_llama import Collectives, ParallelLlamaModel
from conveyor.model.quant import quantize_linears
from conveyor.model.sharding import Shard, layout, local_arch, shard_tensor

logger = logging.getLogger(__name__)

def resolve_quantization(quantization: str, path: Path, device: str = "cpu", dtype: str = "auto",
                         kernel_library: KernelLibrary | None = None, tensor_parallel_size: int = 1,
                         torch_layers: bool = False) -> str:
    """What `quantization` means for this checkpoint and machine: "auto" (and "gguf") keep a GGUF file's
    formats ("gguf") where the quantized kernels can run them (the C kernels on the CPU; torch's layers
    on a GPU, or anywhere with `torch_layers`), else "none". Raises for "gguf" on a folder."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "gguf" and not path.is_file():
        raise ModelLoadError(f"quantization 'gguf' keeps a GGUF file's quantized tensors, but {path} is a "
                             "folder: use 'int8' for float checkpoints")
    if quantization not in ("auto", "gguf"):
        return quantization
    on_device = torch_layers or device != "cpu"
    reasons = [why for why, applies in (
        ("a Hugging Face folder holds float weights", not path.is_file()),
        ("tensor parallelism runs float weights", tensor_parallel_size > 1),
        (f"dtype {dtype} was asked for (the quantized kernels take float32 activations)",
         not on_device and dtype not in ("auto", "float32")),
        ("no C compiler to build the quantized kernels", not on_device and kernel_library is None)) if applies]
    if reasons:
        if quantization == "gguf":   # asked for by name: say it loudly
            logger.warning("quantization gguf not applied, weights dequantized to float: %s", "; ".join(reasons))
        elif path.is_file():
            logger.info("GGUF tensors dequantized to float: %s", "; ".join(reasons))
        return "none"
    return "gguf"


def keeps_on_device(quantization: str, device: str, torch_layers: bool = False) -> bool:
    """Whether a resolved quantization keeps a GGUF file's blocks on the device in torch's layers (a GPU,
    or anywhere with `torch_layers`) rather than on the C kernels."""
    return quantization == "gguf" and (torch_layers or device != "cpu")


def load_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               kernel_library: KernelLibrary | None = None, quantization: str = "none",
               shard: Shard | None = None, comm: Collectives | None = None, torch_layers: bool = False) -> LlamaModel:
    """Build the model for a resolved path and fill in its weights; with a kernel library, the
    linear layers run on its packed matmul, or on weights kept quantized (see model/quant.py).
    `quantization` goes through `resolve_quantization` (a resolved value comes out unchanged).
    A GGUF file kept quantized off the CPU (or anywhere with `torch_layers`) keeps its blocks on the
    device in torch's layers (model/gguf/gpu_quant.py), with activations of any dtype.
    With a shard (and its rank's collectives), only that rank's slice of every tensor is kept."""
    if shard is not None and quantization not in ("none", "auto"):
        raise ModelLoadError("tensor parallelism runs float weights: drop the quantization option")
    quantization = resolve_quantization(quantization, path, device, str(dtype).removeprefix("torch."),
                                        kernel_library, 1 if shard is None else 2, torch_layers)
    on_device = keeps_on_device(quantization, device, torch_layers)
    if quantization == "int8" and (kernel_library is None or dtype != torch.float32):
        logger.warning("quantization %s needs the C kernels and float32 activations; loading float weights",
                       quantization)
        quantization = "none"
    started = time.perf_counter()
    plan: gguf_quant.KeepPlan | None = None
    try:
        if path.is_file():
            arch, weights, freq_factors, plan = open_gguf(path, keep=quantization == "gguf",
                                                          kernel_library=kernel_library, on_device=on_device)
        else:
            arch, weights, freq_factors = open_hf_folder(path)
        if shard is not None and arch.family != "llama":
            raise ModelLoadError(f"tensor parallelism runs the Llama family's layers, not {arch.architecture}")
        if shard is not None and comm is not None:
            full_arch = arch
            arch = local_arch(full_arch, shard)
            weights = ((name, shard_tensor(name, tensor, full_arch, shard)) for name, tensor in weights)
            with torch.device("meta"):
                model = ParallelLlamaModel(arch, full_arch.vocab_size, layout(full_arch, shard).vocab.start, comm,
                                           freq_factors).to(dtype=dtype)
        else:
            with torch.device("meta"):
                model = model_class(arch)(arch, freq_factors).to(dtype=dtype)
            if plan is not None and on_device:
                device_keep.place_holders(model, plan, dtype, device)
            elif plan is not None:
                gguf_quant.place_holders(model, plan, dtype)
        _materialize(model, device)
        for rotary in model.modules():
            if isinstance(rotary, RotaryEmbedding):
                rotary.inv_freq = rotary.inv_freq.to(device)
        model.load_weights(weights)
        if plan is not None and on_device:
            device_keep.materialize(model, plan, dtype, device)
        elif plan is not None:
            gguf_quant.materialize(model, plan, kernel_library)
    except ModelLoadError:
        raise
    except KeyError as exc:
        raise ModelLoadError(f"cannot load {path}: the checkpoint lacks {exc}") from exc
    except (ValueError, TypeError, AttributeError, OSError) as exc:
        raise ModelLoadError(f"cannot load {path}: {exc}") from exc
    model.eval()
    if kernel_library is not None:
        quantize_linears(model, kernel_library, quantization)
        model.use_kernels(kernel_library)
    logger.info("loaded %s (%s, %d layers, %.0fM parameters) as %s on %s in %.2f s", path.name,
                arch.architecture, arch.num_layers, arch.num_parameters / 1e6, dtype, device,
                time.perf_counter() - started)
    return model


def _materialize(model: torch.nn.Module, device: str) -> None:
    """Uninitialised storage for every meta-device parameter and buffer (what `to_empty` does, without
    its route through torch's reference ops, which imports the symbolic-shape machinery: ~0.4 s)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    table[name] = (torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                                   if isinstance(tensor, torch.nn.Parameter) else fresh)


def read_arch(path: Path) -> ModelArch:
    """The shapes of a resolved checkpoint, without its weights."""
    return arch_from_gguf(open_gguf_reader(path))[0] if path.is_file() else arch_from_hf_config(read_hf_config(path))
