"""A GGUF file checked whole before any of its bytes reach C: the tensor table, the architecture's
numbers, every tensor's shape against them, and the scales of every block.

A model file is input like any other: a crafted one must end in a clear error, never in a kernel
reading past a buffer. The C kernels trust their (N, K) and the bytes behind each pointer; this module
is where that trust is earned. Three stages, each called where the file is read:
- `check_layout` (the file opened): every tensor's type, dimensions, byte size and offset inside the
  file, aligned, and not overlapping another tensor;
- `metadata_int` and `check_shapes` (the architecture read): the numbers are sane integers, KV heads
  divide heads, and every tensor has exactly the shape those numbers give it;
- `check_finite` (the weights loaded): no NaN or infinity in a block scale or a float weight.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from conveyor.errors import ModelLoadError

if TYPE_CHECKING:   # the kernels import torch; the file's own checks run without it
    from conveyor.kernels import KernelLibrary

MAX_DIMS = 4                    # GGML_MAX_DIMS: a tensor of more dimensions is not a GGUF tensor
MAX_ARCH_VALUE = 1 << 30        # widths, heads and context lengths beyond any model, well inside int32
FLOAT_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
# Where each block type keeps its 16-bit float scales: (byte offset in the block, how many).
SCALE_FIELDS: dict[str, tuple[int, int]] = {
    "Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2), "Q8_0": (0, 1), "Q8_1": (0, 2),
    "Q2_K": (80, 2), "Q3_K": (108, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1),
    "IQ2_XXS": (0, 1), "IQ2_XS": (0, 1), "IQ3_XXS": (0, 1), "IQ1_S": (0, 1), "IQ4_NL": (0, 1),
    "IQ3_S": (0, 1), "IQ2_S": (0, 1), "IQ4_XS": (0, 1), "TQ1_0": (52, 1), "TQ2_0": (64, 1),
}

SCANNED_TYPES = frozenset({*FLOAT_TYPES, *SCALE_FIELDS, "F64"})


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, as read (dims in GGUF order: the row length first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int          # from the start of the data section


@dataclass(frozen=True)
class TensorLayout:
    """A checked entry: where its bytes are in the file and how they split into rows."""

    info: TensorInfo
    kind: object         # gguf.GGMLQuantizationType
    begin: int           # absolute byte offset
    num_rows: int
    row_bytes: int


def check_alignment(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0 or value & (value - 1):
        raise ValueError(f"general.alignment must be a positive power of two, got {value!r}")
    return int(value)


def check_layout(infos: list[TensorInfo], data_start: int, file_size: int, alignment: int) -> list[TensorLayout]:
    """Every tensor of the table has a known type, 1 to 4 positive dimensions whose row length is a
    whole number of blocks, and bytes inside the file that no other tensor's bytes overlap."""
    import gguf

    seen: set[str] = set()
    layouts = []
    for info in infos:
        name = info.name
        if not name or name in seen:
            raise ValueError(f"tensor name {name!r} is {'empty' if not name else 'listed twice'}")
        seen.add(name)
        if not 1 <= len(info.dims) <= MAX_DIMS:
            raise ValueError(f"tensor {name} has {len(info.dims)} dimensions (1 to {MAX_DIMS} are allowed)")
        if any(d <= 0 for d in info.dims):
            raise ValueError(f"tensor {name} has a dimension that is not positive: {list(info.dims)}")
        try:
            kind = gguf.GGMLQuantizationType(info.type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has an unknown type {info.type_id}") from None
        if info.dims[0] % block:
            raise ValueError(f"tensor {name} ({kind.name}) has rows of {info.dims[0]} values, "
                             f"not a multiple of its block of {block}")
        num_rows = 1
        for d in info.dims[1:]:
            num_rows *= d          # Python integers: no overflow, and the file size bounds the result
        row_bytes = info.dims[0] // block * type_size
        begin = data_start + info.offset
        if info.offset % alignment:
            raise ValueError(f"tensor {name} starts at an unaligned offset {info.offset}")
        if begin + num_rows * row_bytes > file_size:
            raise ValueError(f"tensor {name} ({list(info.dims)}, {kind.name}) runs past the end of the file "
                             "(a truncated download?)")
        layouts.append(TensorLayout(info, kind, begin, num_rows, row_bytes))
    by_start = sorted(layouts, key=lambda t: t.begin)
    for before, after in zip(by_start, by_start[1:]):
        if before.begin + before.num_rows * before.row_bytes > after.begin:
            raise ValueError(f"tensors {before.info.name} and {after.info.name} overlap in the file")
    return layouts


def metadata_int(value: object, key: str, limit: int = MAX_ARCH_VALUE, minimum: int = 1) -> int:
    """A metadata number the model is built from: an integer in [minimum, limit]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ModelLoadError(f"GGUF metadata {key} must be an integer, got {value!r}"[:200])
    if not minimum <= value <= limit:
        raise ModelLoadError(f"GGUF metadata {key} = {value} is out of range ({minimum} to {limit})")
    return int(value)


def metadata_float(value: object, key: str) -> float:
    """A metadata real number (an epsilon, a RoPE base): finite."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value):
        raise ModelLoadError(f"GGUF metadata {key} must be a finite number, got {value!r}"[:200])
    return float(value)


def check_arch(arch) -> None:  # noqa: ANN001 - ModelArch (model/llama.py imports torch)
    """What the kernels assume of the numbers: whole heads, KV heads sharing them evenly, even RoPE."""
    if arch.num_heads % arch.num_kv_heads:
        raise ModelLoadError(f"{arch.num_kv_heads} KV heads do not divide {arch.num_heads} attention heads")
    if arch.head_dim % 2:
        raise ModelLoadError(f"head size {arch.head_dim} is odd; RoPE turns pairs of values")
    if arch.rotary_dim is not None and (arch.rotary_dim <= 0 or arch.rotary_dim % 2):
        raise ModelLoadError(f"rope.dimension_count {arch.rotary_dim} must be positive and even")


def expected_shape(arch, family: str, name: str, names: set[str]) -> tuple[int, ...] | None:  # noqa: ANN001
    """The GGUF shape (row length first) the architecture gives tensor `name`; None for a name it has
    no place for."""
    h, hd, ffn = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    global_shapes = {"token_embd.weight": (h, arch.vocab_size), "output.weight": (h, arch.vocab_size),
                     "output_norm.weight": (h,), "rope_freqs.weight": ((arch.rotary_dim or hd) // 2,)}
    if not name.startswith("blk."):
        return global_shapes.get(name)
    parts = name.split(".")
    if len(parts) != 4 or not parts[1].isdigit() or int(parts[1]) >= arch.num_layers or parts[1] != str(int(parts[1])):
        return None
    kind, suffix = parts[2], parts[3]
    fused_up = family == "phi3" and f"blk.{parts[1]}.ffn_gate.weight" not in names
    outputs = {"attn_q": q, "attn_k": kv, "attn_v": kv, "attn_qkv": q + 2 * kv, "attn_output": h,
               "ffn_gate": ffn, "ffn_up": 2 * ffn if fused_up else ffn, "ffn_down": h}
    inputs = {"attn_output": q, "ffn_down": ffn}
    if kind in outputs:
        if suffix == "bias":
            return (outputs[kind],)
        return (inputs.get(kind, h), outputs[kind]) if suffix == "weight" else None
    norms = {"attn_norm": h, "ffn_norm": h, "post_attention_norm": h, "post_ffw_norm": h,
             "attn_q_norm": hd, "attn_k_norm": hd}
    return (norms[kind],) if kind in norms and suffix == "weight" else None


@functools.cache
def readable(kind: object) -> bool:
    """Whether gguf's dequantization reads this type (a few, as F64 and the integer types, it does not)."""
    import gguf

    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def check_shapes(arch, family: str, tensors: Iterable) -> None:  # noqa: ANN001 - ModelArch, file.Tensor
    """Every tensor has a type we can read and the shape the metadata implies (so the kernels' N and K
    are the layer's)."""
    tensors = list(tensors)
    names = {t.name for t in tensors}
    for t in tensors:
        if not readable(t.tensor_type):
            raise ModelLoadError(f"tensor {t.name} has type {t.tensor_type.name}, which conveyor cannot read")
        shape = tuple(int(d) for d in t.shape)
        want = expected_shape(arch, family, t.name, names)
        if want is None:
            raise ModelLoadError(f"unexpected GGUF tensor {t.name!r} for a {arch.num_layers}-layer "
                                 f"{family} model")
        if shape != want:
            raise ModelLoadError(f"tensor {t.name} has shape {list(shape)}, but the metadata (hidden "
                                 f"{arch.hidden_size}, {arch.num_heads} heads / {arch.num_kv_heads} KV heads "
                                 f"of {arch.head_dim}, feed-forward {arch.intermediate_size}, vocabulary "
                                 f"{arch.vocab_size}) gives it {list(want)}")


def check_finite(tensors: Iterable, lib: KernelLibrary | None) -> None:  # noqa: ANN001 - gguf_file.Tensor
    """No NaN or infinity in any block scale or float weight: a model with one computes NaN logits,
    which sample as nothing at all. Scanned in C, in parallel; numpy without the kernels."""
    import gguf

    from conveyor.kernels import scan

    for t in tensors:
        type_name = t.tensor_type.name
        raw = t.data
        if type_name == "F64" or (type_name in FLOAT_TYPES and not raw.dtype.isnative):   # big-endian
            finite = np.isfinite(raw.reshape(-1))
            where, what = (-1 if finite.all() else int(np.argmin(finite))), "a weight"
        elif type_name in FLOAT_TYPES:   # BF16 comes as bytes: numpy has no such type
            where = scan.first_nonfinite(lib, raw.reshape(-1).view(np.uint8), 4 if type_name == "F32" else 2, 0, 1,
                                         FLOAT_TYPES[type_name])
            what = "a weight"
        elif type_name in SCALE_FIELDS:
            offset, count = SCALE_FIELDS[type_name]
            block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
            where = scan.first_nonfinite(lib, raw.reshape(-1), block_bytes, offset, count, "f16")
            what = "a block scale"
        else:
            continue   # dequantized at load: the float result is checked there (check_dequantized)
        if where >= 0:
            unit = "element" if what == "a weight" else "block"
            raise ModelLoadError(f"tensor {t.name} ({type_name}) has {what} that is NaN or infinite "
                                 f"({unit} {where}): the file is corrupt")


def check_dequantized(name: str, values: np.ndarray) -> None:
    """The float weights of a type `check_finite` does not scan, once dequantized."""
    if not np.isfinite(values).all():
        raise ModelLoadError(f"tensor {name} dequantizes to NaN or infinite weights: the file is corrupt")
