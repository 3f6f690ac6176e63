"""A GGUF file's key-value metadata, read straight from the mapped bytes.

`gguf.GGUFReader` parses every field and tensor into numpy views, one small array per string, which
takes seconds for a 150k-token vocabulary. This reads only the key-value section, and only the keys
asked for; other values are stepped over (fixed-size arrays in one jump).

Layout (GGUF v2/v3): magic "GGUF", version u32, tensor count u64, key count u64, then per key: the
key (a string: u64 length + UTF-8 bytes), value type u32, value. An array value is element type
u32, count u64, elements. The byte order is the file's: a big-endian file reads its version
byte-swapped.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)

# GGUF value types (gguf.GGUFValueType) -> struct code of a scalar; 8 (string), 9 (array) aside.
_STRING, _ARRAY = 8, 9
_SCALAR_CODES: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}

MAX_ARRAY_DEPTH = 4   # an array of arrays (of arrays...): llama.cpp writes none; deeper is a crafted file
# Bytes a table entry takes at the least: a key (8-byte length) and its type; a tensor's name, one dim, type, offset.
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8

# Numeric arrays come as numpy arrays (in native byte order), string arrays as lists.
GGUFValue = int | float | bool | str | list[Any] | np.ndarray


class _Cursor:
    """A read position in a buffer, in one byte order."""

    def __init__(self, buf: memoryview, order: str) -> None:
        self.buf = buf
        self.order = order
        self.pos = 0
        self.array_lengths: dict[str, int] = {}   # key -> element count, for every top-level array
        self._u32 = struct.Struct(order + "I").unpack_from
        self._u64 = struct.Struct(order + "Q").unpack_from

    def u32(self) -> int:
        (value,) = self._u32(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = self._u64(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        size = self.u64()
        end = self.pos + size
        if end > len(self.buf):
            raise ValueError(f"a string of {size} bytes runs past the end of the file at byte {self.pos}")
        text = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings. A vocabulary has 150k of them: one Python step each only to find where
        each length prefix sits; the prefixes then become NUL separators (numpy), and the whole
        array is decoded and split at once."""
        buf, pos, unpack = self.buf, self.pos, self._u64
        first = pos
        prefix_at = [0] * count
        for i in range(count):
            prefix_at[i] = pos
            pos += 8 + unpack(buf, pos)[0]
        if pos > len(buf):
            raise ValueError(f"a string array runs past the end of the file at byte {first}")
        self.pos = pos
        if count == 0:
            return []
        region = np.frombuffer(buf, np.uint8, pos - first, first).copy()
        prefixes = np.asarray(prefix_at, dtype=np.int64) - first
        region[prefixes] = 0
        keep = np.ones(len(region), dtype=bool)
        for k in range(1, 8):
            keep[prefixes + k] = False
        text = region[keep].tobytes().decode("utf-8")  # strict: a bad string fails as it would alone
        if text.count("\0") == count:
            return text.split("\0")[1:]
        # Some string holds a NUL itself: split by the lengths instead.
        return [str(buf[p + 8 : p + 8 + unpack(buf, p)[0]], "utf-8") for p in prefix_at]

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack = self.buf, self.pos, self._u64
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos

    def count(self, min_item_bytes: int, what: str) -> int:
        """A u64 count of items at least `min_item_bytes` each, bounded by the bytes left in the file, so
        a crafted count fails here instead of sizing an allocation."""
        at = self.pos
        count = self.u64()
        if count * min_item_bytes > len(self.buf) - self.pos:
            raise ValueError(f"{what} at byte {at} claims {count} entries, more than the file's remaining "
                             f"{len(self.buf) - self.pos} bytes can hold")
        return count

    def value(self, value_type: int, keep: bool, depth: int = 0) -> GGUFValue | None:
        """The next value of `value_type`; stepped over (None) unless `keep`."""
        if value_type == _STRING:
            if keep:
                return self.string()
            self.pos += 8 + self.u64()
            return None
        if value_type == _ARRAY:
            elem_type = self.u32()
            if elem_type == _STRING:
                count = self.count(8, "a string array")
                if keep:
                    return self.strings(count)
                self.skip_strings(count)
                return None
            if elem_type == _ARRAY:
                # Never written by llama.cpp's tools; read element by element (each an array's element
                # type and count, as gguf's reader takes them), to a bounded depth.
                if depth + 1 >= MAX_ARRAY_DEPTH:
                    raise ValueError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep at byte {self.pos}")
                count = self.count(12, "a nested array")
                items = [self.value(_ARRAY, keep, depth + 1) for _ in range(count)]
                return items if keep else None
            code = _scalar_code(elem_type)
            dtype = np.dtype(code).newbyteorder(self.order)
            count = self.count(dtype.itemsize, "an array")
            start, self.pos = self.pos, self.pos + count * dtype.itemsize
            if not keep:
                return None
            # A copy (astype copies): the file's map closes after reading.
            return np.frombuffer(self.buf, dtype, count, start).astype(dtype.newbyteorder("="))
        code = self.order + _scalar_code(value_type)
        start, self.pos = self.pos, self.pos + struct.calcsize(code)
        return struct.unpack_from(code, self.buf, start)[0] if keep else None


def _scalar_code(value_type: int) -> str:
    code = _SCALAR_CODES.get(value_type)
    if code is None:
        raise ValueError(f"unknown GGUF value type {value_type}")
    return code


def parse_gguf_metadata(buf: memoryview, keys: Collection[str] | None = None) -> dict[str, GGUFValue]:
    """The key-value metadata in a GGUF file's bytes: every key, or only `keys`.

    Values come as `GGUFReader`'s `field.contents()` gives them, except that numeric arrays are numpy
    arrays (a 150k-entry token type list is then one copy, not 150k Python ints).
    """
    wanted = None if keys is None else set(keys)
    metadata, _, _ = parse_header(buf, None if wanted is None else wanted.__contains__, wanted)
    return metadata


def parse_header(buf: memoryview, keep: Callable[[str], bool] | None = None, wanted: set[str] | None = None
                 ) -> tuple[dict[str, GGUFValue], _Cursor, int]:
    """(metadata, a cursor, the tensor count). The keys `keep` accepts (all by default) are read; with
    `wanted`, reading stops once those are in; otherwise the cursor ends at the tensor descriptions."""
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic)")
    order = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # written on a big-endian machine
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(f"unsupported GGUF version {version}; versions {_SUPPORTED_VERSIONS} are read")
    if len(buf) < 24:
        raise ValueError("the GGUF header is cut short")
    cursor = _Cursor(buf, order)
    cursor.pos = 8
    metadata: dict[str, GGUFValue] = {}
    try:
        num_tensors = cursor.count(_MIN_TENSOR_BYTES, "the tensor count")
        num_keys = cursor.count(_MIN_KEY_BYTES, "the key count")
        for _ in range(num_keys):
            key = cursor.string()
            kept = keep is None or keep(key)
            value_type, start = cursor.u32(), cursor.pos
            value = cursor.value(value_type, kept)
            if value_type == _ARRAY:
                cursor.array_lengths[key] = struct.unpack_from(order + "Q", buf, start + 4)[0]
            if kept:
                metadata[key] = value  # type: ignore[assignment]  # kept values are never None
                if wanted is not None and len(metadata) == len(wanted):
                    break  # everything asked for is read; the rest is never touched
    except (struct.error, OverflowError) as exc:  # a read past the end: a truncated file
        raise ValueError(f"the GGUF metadata is cut short at byte {cursor.pos}: {exc}") from exc
    return metadata, cursor, num_tensors


def read_gguf_metadata(path: str | Path, keys: Collection[str] | None = None) -> dict[str, GGUFValue]:
    """`parse_gguf_metadata` of a file, memory-mapped so only the metadata's pages are read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return parse_gguf_metadata(view, keys)
        finally:
            view.release()  # the map cannot close while a view of it is alive
