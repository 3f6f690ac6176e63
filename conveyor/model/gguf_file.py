"""A GGUF file opened the way llama.cpp opens it: the header parsed once, the tensor data memory-mapped.

The metadata is read by gguf_metadata.py (the tokenizer's big arrays are stepped over: the tokenizer
reads them itself); tensors expose what the loaders use of gguf's `ReaderTensor` (name, tensor_type,
shape, data), with `data` a view into the map, so nothing is copied until a loader asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.model.gguf_metadata import GGUFValue, parse_header

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass
class Field:
    """One metadata entry; `contents()` as gguf's ReaderField gives it (lists for arrays)."""

    name: str
    value: GGUFValue

    def contents(self) -> Any:
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


@dataclass
class Tensor:
    name: str
    tensor_type: Any          # gguf.GGMLQuantizationType
    shape: np.ndarray         # GGUF order: the row length first
    data: np.ndarray          # float types shaped (rows..., row length); block types uint8 (rows, row bytes)


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = str(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        metadata, cursor, num_tensors = parse_header(buf, lambda key: not key.startswith("tokenizer.ggml."))
        self.fields = {name: Field(name, value) for name, value in metadata.items()}
        infos = []
        try:
            for _ in range(num_tensors):
                name = cursor.string()
                dims = [cursor.u64() for _ in range(cursor.u32())]
                infos.append((name, dims, cursor.u32(), cursor.u64()))
        except Exception as exc:   # struct.error past the end, a bad name
            raise ValueError(f"the GGUF tensor list is cut short at byte {cursor.pos}: {exc}") from exc
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, dims, type_id, offset in infos:
            try:
                kind = gguf.GGMLQuantizationType(type_id)
            except ValueError as exc:
                raise ValueError(f"tensor {name} has an unknown type {type_id}") from exc
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            row_bytes = dims[0] // block * type_size
            begin = start + offset
            if begin + rows * row_bytes > len(self.data):
                raise ValueError(f"tensor {name} runs past the end of the file (a truncated download?)")
            raw = self.data[begin: begin + rows * row_bytes]
            if kind.name in _FLOAT_DTYPES:
                data = raw.view(np.dtype(_FLOAT_DTYPES[kind.name]).newbyteorder(cursor.order))
                data = data.reshape(tuple(reversed(dims)))
            else:
                data = raw.reshape(rows, row_bytes)
            self.tensors.append(Tensor(name, kind, np.array(dims, dtype=np.uint64), data))
