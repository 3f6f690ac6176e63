"""A GGUF file opened the way llama.cpp opens it: the header parsed once, the tensor data memory-mapped.

gguf's own `GGUFReader` builds numpy views for every element of every metadata array, which takes
tens of seconds for a 150k-token vocabulary. Here scalars are read at open, arrays of numbers become
one numpy view each, and arrays of strings are decoded only when asked for. Tensors expose what the
loaders use of gguf's `ReaderTensor` (name, tensor_type, shape, data), with `data` a view into the map.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file we can read."""


@dataclass
class Field:
    """One metadata entry; `contents()` as gguf's ReaderField gives it (lists for arrays)."""

    name: str
    value_type: int
    _value: Any = None
    _strings: tuple[memoryview, int, int] | None = None   # (buffer, offset, count) of a string array

    def contents(self) -> Any:
        if self._strings is not None:
            buf, pos, count = self._strings
            out = []
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buf, pos)
                out.append(bytes(buf[pos + 8: pos + 8 + length]).decode("utf-8", errors="replace"))
                pos += 8 + length
            self._value, self._strings = out, None
        if isinstance(self._value, np.ndarray):
            return self._value.tolist()
        return self._value

    def array(self) -> np.ndarray:
        """A numeric array field as numpy (no copy)."""
        if not isinstance(self._value, np.ndarray):
            raise TypeError(f"GGUF field {self.name} is not a numeric array")
        return self._value


@dataclass
class Tensor:
    name: str
    tensor_type: Any          # gguf.GGMLQuantizationType
    shape: np.ndarray         # GGUF order: the row length first
    data: np.ndarray          # float types shaped (rows..., row length); block types uint8 (rows, row bytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = str(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        pos = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            name, pos = _string(buf, pos)
            (value_type,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            field, pos = _value(buf, pos, name, value_type)
            self.fields[name] = field
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, type_id, offset))
        alignment_field = self.fields.get("general.alignment")
        alignment = int(alignment_field.contents()) if alignment_field is not None else 32
        start = -(-pos // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, dims, type_id, offset in infos:
            try:
                kind = gguf.GGMLQuantizationType(type_id)
            except ValueError as exc:
                raise GGUFFormatError(f"tensor {name} has an unknown type {type_id}") from exc
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            row_bytes = dims[0] // block * type_size
            begin = start + offset
            if begin + rows * row_bytes > len(self.data):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated download?)")
            raw = self.data[begin: begin + rows * row_bytes]
            if kind.name in _FLOAT_DTYPES:
                data = raw.view(_FLOAT_DTYPES[kind.name]).reshape(tuple(reversed(dims)))
            else:
                data = raw.reshape(rows, row_bytes)
            self.tensors.append(Tensor(name, kind, np.array(dims, dtype=np.uint64), data))


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8: pos + 8 + length]).decode("utf-8", errors="replace"), pos + 8 + length


def _value(buf: memoryview, pos: int, name: str, value_type: int) -> tuple[Field, int]:
    if value_type in _SCALARS:
        fmt, _ = _SCALARS[value_type]
        return Field(name, value_type, struct.unpack_from(fmt, buf, pos)[0]), pos + struct.calcsize(fmt)
    if value_type == _STRING:
        text, pos = _string(buf, pos)
        return Field(name, value_type, text), pos
    if value_type != _ARRAY:
        raise GGUFFormatError(f"metadata {name} has an unknown value type {value_type}")
    elem_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if elem_type in _SCALARS:
        dtype = np.dtype(_SCALARS[elem_type][1])
        values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
        return Field(name, value_type, values), pos + count * dtype.itemsize
    if elem_type == _STRING:
        start = pos
        for _ in range(count):   # only the lengths, to find the end; decoded on demand
            (length,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + length
        return Field(name, value_type, _strings=(buf, start, count)), pos
    raise GGUFFormatError(f"metadata {name} is an array of a type we cannot read ({elem_type})")
