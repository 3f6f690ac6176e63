"""A GGUF file opened the way llama.cpp opens it: the header parsed once, the tensor data memory-mapped.

The metadata is read by metadata.py (the tokenizer's big arrays are stepped over: the tokenizer
reads them itself); tensors expose what the loaders use of gguf's `ReaderTensor` (name, tensor_type,
shape, data), with `data` a view into the map, so nothing is copied until a loader asks. The tensor
table is checked whole (validate.check_layout) before any view is made.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.model.gguf.metadata import GGUFValue, parse_header
from conveyor.model.gguf.validate import MAX_DIMS, TensorInfo, check_alignment, check_layout

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
        self.path = str(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        metadata, cursor, num_tensors = parse_header(buf, lambda key: not key.startswith("tokenizer.ggml."))
        self.fields = {name: Field(name, value) for name, value in metadata.items()}
        self.array_lengths = cursor.array_lengths   # also of the arrays not read (the vocabulary)
        infos = []
        try:
            for _ in range(num_tensors):
                name = cursor.string()
                num_dims = cursor.u32()
                if not 1 <= num_dims <= MAX_DIMS:
                    raise ValueError(f"tensor {name[:80]!r} has {num_dims} dimensions (1 to {MAX_DIMS} are allowed)")
                dims = tuple(cursor.u64() for _ in range(num_dims))
                infos.append(TensorInfo(name, dims, cursor.u32(), cursor.u64()))
        except (struct.error, OverflowError) as exc:   # a read past the end (or past any offset)
            raise ValueError(f"the GGUF tensor list is cut short at byte {cursor.pos}: {exc}") from exc
        alignment = check_alignment(metadata.get("general.alignment", 32))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: list[Tensor] = []
        for layout in check_layout(infos, start, len(self.data), alignment):
            info, kind = layout.info, layout.kind
            raw = self.data[layout.begin: layout.begin + layout.num_rows * layout.row_bytes]
            if kind.name in _FLOAT_DTYPES:
                data = raw.view(np.dtype(_FLOAT_DTYPES[kind.name]).newbyteorder(cursor.order))
                data = data.reshape(tuple(reversed(info.dims)))
            else:
                data = raw.reshape(layout.num_rows, layout.row_bytes)
            self.tensors.append(Tensor(info.name, kind, np.array(info.dims, dtype=np.uint64), data))
