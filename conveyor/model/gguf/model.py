"""A GGUF file -> ModelArch and Hugging Face-named tensors (the kept-quantized layers aside: quant.py)."""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from conveyor.errors import ModelLoadError
from conveyor.kernels import KernelLibrary
from conveyor.model.gguf import device_keep
from conveyor.model.gguf import quant as gguf_quant
from conveyor.model.checkpoint import GGUF_ARCHITECTURES, SUPPORTED
from conveyor.model.gguf.file import GGUFFile
from conveyor.model.gguf.validate import (MAX_ARCH_VALUE, SCANNED_TYPES, check_arch, check_dequantized,
                                          check_finite, check_shapes, metadata_float, metadata_int)
from conveyor.model.llama import ModelArch


def open_gguf_reader(path: Path) -> GGUFFile:
    try:
        return gguf_reader(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_reader(path: Path) -> GGUFFile:
    """A GGUF file's parsed metadata and mapped tensors for the weights' loaders (the tokenizer reads
    its own keys with metadata.py). Keyed by the file's identity, so a rewritten file is parsed again."""
    stat = path.stat()
    return _parsed_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:  # noqa: ARG001 - the key, not the input
    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default=None):  # noqa: ANN001, ANN201 - values of any type
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def arch_from_gguf(reader) -> tuple[ModelArch, str]:  # noqa: ANN001
    name = gguf_field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {name!r}. Supported: {SUPPORTED}.")

    def meta(key: str, default=None):  # noqa: ANN001, ANN202
        value = gguf_field(reader, f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {name}.{key}")
        return value

    def number(key: str, default: int | None = None, minimum: int = 1, limit: int = MAX_ARCH_VALUE) -> int:
        return metadata_int(meta(key, default), f"{name}.{key}", limit, minimum)

    tensor_names = {t.name: t for t in reader.tensors}
    embed = tensor_names.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    hidden = number("embedding_length")
    num_heads = number("attention.head_count")
    # Every layer holds tensors of its own: a count past the tensors' is a crafted file, not a model.
    num_layers = number("block_count", limit=len(reader.tensors))
    scaling_type = gguf_field(reader, f"{name}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": metadata_float(
            gguf_field(reader, f"{name}.rope.scaling.factor"), f"{name}.rope.scaling.factor")}
    vocab_size = (number("vocab_size", 0, minimum=0) or int(embed.shape[-1])) if len(embed.shape) == 2 else 0
    if vocab_size <= 0:
        raise ModelLoadError(f"token_embd.weight has shape {list(map(int, embed.shape))}: not (hidden, vocabulary)")
    head_dim = number("attention.key_length", max(hidden // num_heads, 1))
    num_tokens = reader.array_lengths.get("tokenizer.ggml.tokens", 0)
    if num_tokens > vocab_size:   # every id past the table would fail the request that sampled or sent it
        raise ModelLoadError(f"the tokenizer has {num_tokens} tokens but the model's vocabulary only {vocab_size}")
    sliding = tuple([False] * num_layers)
    window = None
    gemma = {}
    if name == "gemma3":
        window = number("attention.sliding_window", 0, minimum=0)
        if window > 0:
            sliding = _gemma3_sliding_layers(gguf_field(reader, f"{name}.attention.sliding_window_pattern"),
                                             num_layers)
        if float(gguf_field(reader, f"{name}.final_logit_softcapping", 0.0)):
            raise ModelLoadError("this Gemma 3 file softcaps its logits, which conveyor does not implement")
        # As llama.cpp reads these files: the sliding layers' RoPE base defaults to 10k; q.k scales by
        # 1/sqrt(head_dim), except in the 27B model (62 layers), whose query_pre_attn_scalar is hidden / heads.
        gemma = dict(family="gemma3", hidden_act="gelu_tanh",
                     rope_local_theta=float(gguf_field(reader, f"{name}.rope.freq_base_swa", 10_000.0)),
                     attn_scale=(max(hidden // num_heads, 1) if num_layers == 62 else head_dim) ** -0.5)
    arch = ModelArch(
        architecture=f"gguf:{name}",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=number("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=number("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=metadata_float(meta("attention.layer_norm_rms_epsilon"),
                                    f"{name}.attention.layer_norm_rms_epsilon"),
        rope_theta=metadata_float(meta("rope.freq_base", 10000.0), f"{name}.rope.freq_base"),
        rope_scaling=rope_scaling,
        max_position_embeddings=number("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        sliding_window=window if any(sliding) else None,
        sliding_layers=sliding,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rotary_dim=_rotary_dim(gguf_field(reader, f"{name}.rope.dimension_count"), head_dim),
        **gemma,
    )
    check_arch(arch)
    check_shapes(arch, name, reader.tensors)
    return arch, name


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _gemma3_sliding_layers(pattern, num_layers: int) -> tuple[bool, ...]:  # noqa: ANN001 - int or list
    """Which layers slide: a file may list them (True: sliding) or give the period; else every 6th is global."""
    if isinstance(pattern, (list, np.ndarray)) and len(pattern) == num_layers:
        return tuple(bool(p) for p in pattern)
    period = int(pattern) if isinstance(pattern, (int, np.integer)) and pattern > 0 else 6
    return tuple((i + 1) % period != 0 for i in range(num_layers))


def _rotary_dim(count: object, head_dim: int) -> int | None:
    if count is None:
        return None
    count = metadata_int(count, "rope.dimension_count")
    return None if count >= head_dim else count


# Architectures whose files fuse what llama.cpp's llama files keep apart (Phi-3: q/k/v in attn_qkv,
# gate and up in ffn_up, gate first, as Hugging Face's gate_up_proj).
_GGUF_FUSED_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# Gemma 3 has norms before and after both attention and MLP; its ffn_norm is the one before the MLP.
_GGUF_FAMILY_NAMES = {**_GGUF_FUSED_NAMES, "gemma3": {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm"}}


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves q/k rows per head for its RoPE layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path, keep: bool = False, kernel_library: KernelLibrary | None = None,
              on_device: bool = False) -> tuple[ModelArch, Iterator[tuple[str, torch.Tensor]], torch.Tensor | None,
                                                gguf_quant.KeepPlan | None]:
    """With `keep`, also the plan of which tensors stay in their formats (quant.py for the C kernels;
    device_keep.py with `on_device`, for torch's layers); the weights iterator then dequantizes only
    the others. Every block scale and float weight is checked finite before it is used (with the
    kernels' scan where given)."""
    import gguf

    reader = open_gguf_reader(path)
    arch, name = arch_from_gguf(reader)
    row_orders = {}   # q/k weights and biases: the file row of each of our rows
    if name == "llama":   # llama.cpp's converter interleaved these rows; we rotate halves
        for t in reader.tensors:
            parts = t.name.split(".")
            if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
                heads = arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads
                row_orders[t.name] = _unpermute_rope_rows(np.arange(int(t.shape[-1])), heads)
    plan = None
    if keep:
        plan = (device_keep.plan_on_device if on_device else gguf_quant.plan_kept)(reader, arch, row_orders)
    skipped = plan.skipped if plan is not None else set()
    # A repacked layer's tensors are scanned just before the repack reads them (quant.py), the rest now.
    repacked = {part.tensor.name for parts in (plan.layers.values() if plan and not on_device else ())
                for part in parts}
    check_finite([t for t in reader.tensors if t.name not in repacked], kernel_library)
    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(-1))

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            if t.name == "rope_freqs.weight" or t.name in skipped:
                continue
            parts = t.name.split(".")
            if parts[0] == "blk":
                layer, kind, suffix = parts[1], parts[2], parts[3]
                names = {**_GGUF_NAMES, **_GGUF_FAMILY_NAMES.get(name, {})}
                if kind not in names:
                    raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
                hf_name = f"model.layers.{layer}.{names[kind]}.{suffix}"
            elif parts[0] in _GGUF_GLOBAL_NAMES:
                prefix = "" if parts[0] == "output" else "model."
                hf_name = f"{prefix}{_GGUF_GLOBAL_NAMES[parts[0]]}.{parts[-1]}"
            else:
                raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
            # Shaped as the file says: a 1-D tensor of a block type (BF16 too) dequantizes to one row.
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            if t.tensor_type.name not in SCANNED_TYPES:
                check_dequantized(t.name, w)
            if t.name in row_orders:
                w = w[row_orders[t.name]]
            yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy

    return arch, weights(), freq_factors, plan
