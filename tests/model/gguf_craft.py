"""Tiny GGUF files written from a plain description, so a test can break any one field of a valid file:
a dimension, a type, an offset, a metadata value, the bytes of a block.

`tiny_spec()` describes a valid 2-layer Llama (hidden 64, or 256 for the K-quants) with a small
byte-level tokenizer; `encode(spec)` lays it out as GGUF v3 does (tensor data aligned, offsets in
order unless a tensor names its own).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import gguf
import numpy as np

from gguf_blocks import llama_layer_shapes, random_blocks

UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64 = 4, 5, 6, 7, 8, 9, 10
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
T = gguf.GGMLQuantizationType
HEADS, KV_HEADS, LAYERS, VOCAB, CONTEXT = 4, 2, 2, 96, 256


@dataclass
class TensorSpec:
    name: str
    dims: list[int]              # GGUF order: the row length first
    type_id: int
    data: bytes
    offset: int | None = None    # None: placed after the previous tensor


@dataclass
class Spec:
    kv: dict[str, tuple[int, object]]          # key -> (GGUF value type, value); arrays: (ARRAY, (elem type, list))
    tensors: list[TensorSpec] = field(default_factory=list)
    version: int = 3

    def tensor(self, name: str) -> TensorSpec:
        return next(t for t in self.tensors if t.name == name)


def _value(value_type: int, value: object) -> bytes:
    if value_type == STRING:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    if value_type == ARRAY:
        elem_type, items = value
        return struct.pack("<IQ", elem_type, len(items)) + b"".join(_value(elem_type, v) for v in items)
    return struct.pack("<" + _SCALARS[value_type], value)


def encode(spec: Spec) -> bytes:
    alignment = spec.kv.get("general.alignment", (UINT32, 32))[1]
    if not isinstance(alignment, int) or not 0 < alignment <= 1 << 16:
        alignment = 32   # a broken value is written as is; the data is laid out as for the default
    out = [b"GGUF", struct.pack("<IQQ", spec.version, len(spec.tensors), len(spec.kv))]
    for key, (value_type, value) in spec.kv.items():
        out.append(_value(STRING, key) + struct.pack("<I", value_type) + _value(value_type, value))
    offsets, cursor = [], 0
    for t in spec.tensors:
        if t.offset is not None:       # a tensor placed by hand takes no room of its own
            offsets.append(t.offset)
            continue
        offsets.append(cursor)
        cursor = -(-(cursor + len(t.data)) // alignment) * alignment
    for t, offset in zip(spec.tensors, offsets):
        out.append(_value(STRING, t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
                   + struct.pack("<IQ", t.type_id, offset))
    head = b"".join(out)
    start = -(-len(head) // alignment) * alignment
    body = bytearray(cursor)
    for t, offset in zip(spec.tensors, offsets):
        if t.offset is None:
            body[offset: offset + len(t.data)] = t.data
    return head + b"\0" * (start - len(head)) + bytes(body)


def _tensor(name: str, shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> TensorSpec:
    """shape in numpy order (rows, row length), as GGUFWriter takes it."""
    qtype = getattr(T, kind)
    if kind.endswith("_K"):
        raw = random_blocks(kind.lower(), shape[0], shape[1], seed=int(rng.integers(1 << 30)), scale=0.2)
    else:
        w = (rng.standard_normal(shape) * (1.0 if name == "token_embd.weight" else 0.2)).astype(np.float32)
        if name.endswith("norm.weight"):
            w += 1.0
        raw = w if kind == "F32" else gguf.quants.quantize(w, qtype)
    return TensorSpec(name, list(reversed(shape)), int(qtype), np.ascontiguousarray(raw).tobytes())


def tiny_spec(kquant: bool = False, seed: int = 0) -> Spec:
    """A valid tiny Llama: Q8_0 / Q4_0 / Q4_1 weights and a Q8_0 embedding (hidden 64), or with
    `kquant` Q4_K / Q6_K / Q5_0 weights and a Q6_K embedding (hidden 256)."""
    rng = np.random.default_rng(seed)
    hidden, ffn = (256, 512) if kquant else (64, 128)
    types = ({"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
              "ffn_up": "Q4_K", "ffn_down": "Q6_K"} if kquant else
             {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
              "ffn_up": "Q4_1", "ffn_down": "Q4_0"})
    tokens = [f"<{i}>" for i in range(3)] + [chr(c) for c in range(ord("a"), ord("a") + VOCAB - 4)] + ["ab"]
    kv: dict[str, tuple[int, object]] = {
        "general.architecture": (STRING, "llama"),
        "general.alignment": (UINT32, 32),
        "llama.block_count": (UINT32, LAYERS),
        "llama.context_length": (UINT32, CONTEXT),
        "llama.embedding_length": (UINT32, hidden),
        "llama.feed_forward_length": (UINT32, ffn),
        "llama.attention.head_count": (UINT32, HEADS),
        "llama.attention.head_count_kv": (UINT32, KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": (FLOAT32, 1e-5),
        "llama.rope.freq_base": (FLOAT32, 10000.0),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "default"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, tokens)),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, [3, 3, 3] + [1] * (VOCAB - 3))),
        "tokenizer.ggml.merges": (ARRAY, (STRING, ["a b"])),
        "tokenizer.ggml.bos_token_id": (UINT32, 1),
        "tokenizer.ggml.eos_token_id": (UINT32, 2),
    }
    spec = Spec(kv)
    add = lambda name, shape, kind="F32": spec.tensors.append(_tensor(name, shape, kind, rng))  # noqa: E731
    add("token_embd.weight", (VOCAB, hidden), "Q6_K" if kquant else "Q8_0")
    add("output_norm.weight", (hidden,))
    shapes = llama_layer_shapes(hidden, ffn, HEADS, KV_HEADS)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        for kind, shape in shapes.items():
            add(f"blk.{i}.{kind}.weight", shape, types[kind])
    return spec


def requantized(spec: Spec, name: str, shape: tuple[int, ...], kind: str, seed: int = 1) -> None:
    """Replace tensor `name` by fresh weights of `shape` (numpy order) in `kind`."""
    fresh = _tensor(name, shape, kind, np.random.default_rng(seed))
    old = spec.tensor(name)
    old.dims, old.type_id, old.data = fresh.dims, fresh.type_id, fresh.data
