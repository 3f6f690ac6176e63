"""A crafted GGUF file ends in a ModelLoadError that says what is wrong, before any of its bytes reach
the C kernels: each case here once crashed, corrupted memory, allocated gigabytes or loaded a model
that answered nothing."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.errors import ModelLoadError
from conveyor.model.gguf.metadata import read_gguf_metadata
from conveyor.model.checkpoint import resolve_model_path
from conveyor.model.loader import load_model, read_arch

from gguf_craft import ARRAY, INT32, STRING, UINT32, UINT64, Spec, T, TensorSpec, encode, requantized, tiny_spec

LIB = kernels.library()


def write(tmp_path: Path, spec: Spec, name: str = "crafted.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(encode(spec))
    return path


def load(path: Path, quantization: str = "gguf") -> torch.nn.Module:
    return load_model(path, torch.float32, kernel_library=LIB, quantization=quantization if LIB else "none")


def load_error(path: Path, quantization: str = "gguf") -> str:
    with pytest.raises(ModelLoadError) as info:
        load(path, quantization)
    return str(info.value)


@pytest.mark.parametrize("kquant", [False, True], ids=["legacy", "kquant"])
@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_the_crafted_base_file_loads(tmp_path: Path, kquant: bool, quantization: str) -> None:
    """Every broken file below is this one with one thing changed."""
    model = load(write(tmp_path, tiny_spec(kquant)), quantization)
    assert model.arch.num_layers == 2


def _dims(name: str, dims: list[int]) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        spec.tensor(name).dims = dims
    return edit


def _meta(key: str, value_type: int, value: object) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        spec.kv[key] = (value_type, value)
    return edit


def _offset(name: str, offset: int) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        spec.tensor(name).offset = offset
    return edit


def _overlap(spec: Spec) -> None:
    spec.tensor("blk.0.attn_q.weight").offset = 0   # where token_embd's bytes are


def _duplicate(spec: Spec) -> None:
    spec.tensor("blk.1.attn_norm.weight").name = "blk.0.attn_norm.weight"


def _widen(name: str, shape: tuple[int, ...], kind: str) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        requantized(spec, name, shape, kind)
    return edit


def _wide_ffn(spec: Spec) -> None:
    for kind, shape in (("ffn_gate", (512, 64)), ("ffn_up", (512, 64)), ("ffn_down", (64, 512))):
        requantized(spec, f"blk.1.{kind}.weight", shape, "Q4_0")


def _extra(name: str) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        spec.tensors.append(TensorSpec(name, [64], int(T.F32), np.ones(64, np.float32).tobytes()))
    return edit


def _retype(name: str, kind: object) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        t = spec.tensor(name)
        t.type_id = int(kind)
        t.data = np.frombuffer(t.data, np.float32).astype(np.float64).tobytes()
    return edit


def _nested(depth: int) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        value: tuple[int, object] = (INT32, [1])
        for _ in range(depth):
            value = (ARRAY, [value])
        spec.kv["general.nested"] = (ARRAY, value)
    return edit


# (id, edit, words the message must hold)
STRUCTURE = [
    ("embedding-trailing-zero-dim", _dims("token_embd.weight", [64, 0]), "not positive"),
    ("kept-weight-zero-bytes", _dims("blk.0.attn_q.weight", [64, 0]), "not positive"),
    ("dims-overflow-int64", _dims("token_embd.weight", [64, 1 << 62, 1 << 62]), "past the end"),
    ("dims-past-the-end", _dims("token_embd.weight", [64, 100_000]), "past the end"),
    ("five-dims", _dims("output_norm.weight", [64, 1, 1, 1, 1]), "dimensions"),
    ("row-not-whole-blocks", _dims("blk.0.attn_q.weight", [48, 64]), "multiple of its block"),
    ("unknown-type", lambda s: setattr(s.tensor("blk.0.attn_k.weight"), "type_id", 99), "unknown type 99"),
    ("offset-past-the-end", _offset("blk.1.ffn_down.weight", 1 << 40), "past the end"),
    ("offset-unaligned", _offset("blk.1.ffn_down.weight", 3), "unaligned"),
    ("tensors-overlap", _overlap, "overlap"),
    ("name-listed-twice", _duplicate, "listed twice"),
    ("alignment-zero", _meta("general.alignment", UINT32, 0), "power of two"),
    ("alignment-three", _meta("general.alignment", UINT32, 3), "power of two"),
    ("alignment-a-string", _meta("general.alignment", STRING, "32"), "power of two"),
    ("tokens-2^28-in-a-small-file", _meta("tokenizer.ggml.tokens", ARRAY, (STRING, [])), "claims"),
    ("arrays-nested-deep", _nested(50), "nested"),
    ("block-count-2^31", _meta("llama.block_count", UINT64, 1 << 31), "block_count"),
    ("head-count-zero", _meta("llama.attention.head_count", UINT32, 0), "head_count"),
    ("kv-heads-not-dividing", _meta("llama.attention.head_count_kv", UINT32, 3), "do not divide"),
    ("ffn-length-an-array", _meta("llama.feed_forward_length", ARRAY, (UINT32, [128, 512])), "integer"),
    ("eps-a-string", _meta("llama.attention.layer_norm_rms_epsilon", STRING, "tiny"), "finite number"),
    ("attn-output-wider-than-hidden", _widen("blk.0.attn_output.weight", (128, 64), "Q4_0"), "attn_output"),
    ("layer-1-ffn-4x-wider", _wide_ffn, "blk.1.ffn"),
    ("hidden-256-weights-64", _meta("llama.embedding_length", UINT32, 256), "shape"),
    ("kept-weight-k-wider-than-hidden", _widen("blk.0.attn_q.weight", (64, 128), "Q8_0"), "blk.0.attn_q"),
    ("layer-past-block-count", _extra("blk.2.attn_norm.weight"), "unexpected"),
    ("unknown-tensor", _extra("blk.0.attn_extra.weight"), "unexpected"),
    ("a-type-nothing-reads", _retype("blk.1.ffn_norm.weight", T.F64), "cannot read"),
    ("more-tokens-than-embedding-rows", _widen("token_embd.weight", (64, 64), "Q8_0"), "96 tokens"),
]


@pytest.mark.parametrize("case", STRUCTURE, ids=[c[0] for c in STRUCTURE])
def test_crafted_structure_is_a_clean_error(tmp_path: Path, case: tuple) -> None:
    _, edit, words = case
    spec = tiny_spec()
    edit(spec)
    data = encode(spec)
    if case[0] == "tokens-2^28-in-a-small-file":   # the count field of the (empty) token array
        at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4
        data = data[:at] + struct.pack("<Q", 1 << 28) + data[at + 8:]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    message = load_error(path)
    assert words in message, message
    with pytest.raises(ModelLoadError):
        read_arch(path)   # the front's look at the shapes fails the same way


def test_a_token_count_past_the_file_fails_before_allocating(tmp_path: Path) -> None:
    spec = tiny_spec()
    data = encode(spec)
    at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4
    path = tmp_path / "tokens.gguf"
    path.write_bytes(data[:at] + struct.pack("<Q", 1 << 28) + data[at + 8:])
    with pytest.raises(ValueError, match="claims 268435456 entries"):
        read_gguf_metadata(path)   # the tokenizer's reader


def _set_f16(spec: Spec, name: str, block_bytes: int, block: int, offset: int, value: float) -> None:
    t = spec.tensor(name)
    data = bytearray(t.data)
    at = block * block_bytes + offset
    data[at: at + 2] = np.float16(value).tobytes()
    t.data = bytes(data)


def _set_f32(spec: Spec, name: str, index: int, value: float) -> None:
    t = spec.tensor(name)
    data = bytearray(t.data)
    data[4 * index: 4 * index + 4] = np.float32(value).tobytes()
    t.data = bytes(data)


def _bf16_with_inf(spec: Spec, name: str, index: int) -> None:
    t = spec.tensor(name)
    bits = (np.frombuffer(t.data, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits[index] = 0x7F80
    t.type_id, t.data = int(T.BF16), bits.tobytes()


def _f16_with_nan(spec: Spec, name: str, index: int) -> None:
    t = spec.tensor(name)
    values = np.frombuffer(t.data, np.float32).astype(np.float16)
    values[index] = np.nan
    t.type_id, t.data = int(T.F16), values.tobytes()


# (id, K-quant file, edit)
SCALES = [
    ("q4_k-d-nan", True, lambda s: _set_f16(s, "blk.0.attn_q.weight", 144, 5, 0, np.nan)),
    ("q4_k-dmin-inf", True, lambda s: _set_f16(s, "blk.1.ffn_up.weight", 144, 0, 2, np.inf)),
    ("q6_k-d-inf", True, lambda s: _set_f16(s, "blk.0.attn_v.weight", 210, 3, 208, -np.inf)),
    ("q6_k-embedding-d-nan", True, lambda s: _set_f16(s, "token_embd.weight", 210, 40, 208, np.nan)),
    ("q5_0-d-nan", True, lambda s: _set_f16(s, "blk.1.attn_output.weight", 22, 17, 0, np.nan)),
    ("q8_0-embedding-d-nan", False, lambda s: _set_f16(s, "token_embd.weight", 34, 7, 0, np.nan)),
    ("q4_0-d-inf", False, lambda s: _set_f16(s, "blk.0.ffn_down.weight", 18, 2, 0, np.inf)),
    ("q4_1-m-nan", False, lambda s: _set_f16(s, "blk.1.ffn_gate.weight", 20, 9, 2, np.nan)),
    ("f32-norm-nan", False, lambda s: _set_f32(s, "blk.1.ffn_norm.weight", 63, np.nan)),
    ("bf16-norm-inf", False, lambda s: _bf16_with_inf(s, "blk.0.attn_norm.weight", 17)),
    ("f16-norm-nan", False, lambda s: _f16_with_nan(s, "output_norm.weight", 5)),
]


@pytest.mark.parametrize("quantization", ["gguf", "none"])
@pytest.mark.parametrize("case", SCALES, ids=[c[0] for c in SCALES])
def test_a_non_finite_scale_is_a_load_error_naming_the_tensor(tmp_path: Path, case: tuple, quantization: str) -> None:
    name, kquant, edit = case
    spec = tiny_spec(kquant)
    edit(spec)
    message = load_error(write(tmp_path, spec), quantization)
    assert "NaN or infinite" in message, message
    edited = [t.name for t, o in zip(spec.tensors, tiny_spec(kquant).tensors) if t.data != o.data]
    assert edited and edited[0] in message, message


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan"])
def test_a_type_without_a_kernel_is_scanned_too(tmp_path: Path, bad: bool) -> None:
    """Q2_K has no kernel: it is dequantized and requantized to Q8_0, after the same scan."""
    spec = tiny_spec(kquant=True)
    blocks = np.random.default_rng(0).integers(0, 256, size=(256, 84), dtype=np.uint8)
    blocks[:, 80:84] = np.full((256, 2), 0.001, np.float16).view(np.uint8)   # d and dmin
    if bad:
        blocks[7, 82:84] = np.array([np.inf], np.float16).view(np.uint8)
    t = spec.tensor("blk.0.attn_output.weight")
    t.type_id, t.data = int(T.Q2_K), blocks.tobytes()
    path = write(tmp_path, spec)
    if bad:
        assert "blk.0.attn_output.weight (Q2_K) has a block scale that is NaN or infinite" in load_error(path)
    else:
        assert load(path).arch.num_layers == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cli_reports_a_crafted_file_with_status_2(tmp_path: Path, command: str) -> None:
    spec = tiny_spec()
    spec.tensor("token_embd.weight").dims = [64, 0]
    path = write(tmp_path, spec)
    args = (["generate", "hi", "--raw", "--max-tokens", "2"] if command == "generate"
            else ["serve", "--port", str(_free_port())])
    result = subprocess.run([sys.executable, "-m", "conveyor", *args, "--model", str(path), "--threads", "1"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "token_embd.weight has a dimension that is not positive" in result.stderr


def test_a_merge_outside_the_vocabulary_is_a_clean_error(tmp_path: Path) -> None:
    from conveyor.text.gguf_vocab import tokenizer_from_gguf

    spec = tiny_spec()
    spec.kv["tokenizer.ggml.merges"] = (ARRAY, (STRING, ["a c"]))
    with pytest.raises(ValueError, match="merges do not fit its tokens"):
        tokenizer_from_gguf(write(tmp_path, spec))


@pytest.mark.skipif(LIB is None, reason="no C compiler")
@pytest.mark.parametrize("fmt,block_bytes,offset,count", [("f16", 144, 0, 2), ("f16", 210, 208, 1), ("f16", 2, 0, 1),
                                                          ("bf16", 2, 0, 1), ("f32", 4, 0, 1), ("f16", 20, 2, 1)])
def test_the_c_scan_finds_what_numpy_finds(fmt: str, block_bytes: int, offset: int, count: int) -> None:
    from conveyor.kernels import scan

    rng = np.random.default_rng(0)
    num_blocks = 200_003   # several of the scan's chunks, the last one short
    clean = {"f16": np.float16, "bf16": np.float16, "f32": np.float32}[fmt]
    raw = np.zeros((num_blocks, block_bytes), np.uint8)
    values = rng.standard_normal((num_blocks, count)).astype(clean).view(np.uint8)
    raw[:, offset: offset + values.shape[1]] = values
    flat = raw.reshape(-1)
    assert scan.first_nonfinite(LIB, flat, block_bytes, offset, count, fmt) == -1
    for bad_block in (num_blocks - 1, 150_000, 70_000, 3):
        inf = {"f16": b"\x00\x7c", "bf16": b"\x80\xff", "f32": b"\x00\x00\xc0\x7f"}[fmt]
        at = bad_block * block_bytes + offset + (count - 1) * len(inf)
        flat[at: at + len(inf)] = np.frombuffer(inf, np.uint8)
        assert scan.first_nonfinite(LIB, flat, block_bytes, offset, count, fmt) == bad_block
        assert scan.first_nonfinite(None, flat, block_bytes, offset, count, fmt) == bad_block


def test_a_fifo_as_the_model_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="neither a regular file nor a folder"):
        resolve_model_path(str(fifo))


def test_float16_and_bfloat16_weights_pass_the_scan(tmp_path: Path) -> None:
    spec = tiny_spec()
    _bf16_with_inf(spec, "blk.0.attn_norm.weight", 0)
    _f16_with_nan(spec, "output_norm.weight", 0)
    for name in ("blk.0.attn_norm.weight", "output_norm.weight"):   # the bad value made good again
        t = spec.tensor(name)
        t.data = b"\x80\x3f" + t.data[2:] if t.type_id == int(T.BF16) else b"\x00\x3c" + t.data[2:]
    assert load(write(tmp_path, spec)).arch.num_layers == 2
