"""The weight formats the C kernels run, read from the one table that defines them: KN_FORMATS in
kernels.h, where the compiler checks each row against the typed structs of the file's blocks and of
our panels. Python never spells a format's code or size itself.

`check` compares the table as read here with the one a built library reports (kn_formats, formats.c),
so a header edited out of step with its kernels, or a library built from other sources, fails at load.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("kernels.h")
QK = 32   # weights per block along K (kernels.h)


@dataclass(frozen=True)
class BlockFormat:
    """One row of KN_FORMATS (kernels.h explains each column)."""

    gguf_type: str       # "Q4_K"
    name: str            # "q4_k"
    code: int            # FMT_Q4_K
    block_weights: int   # weights per file block along K (and per unit of a panel)
    block_bytes: int     # bytes per file block
    act_group: int       # k per activation scale: 32 or 256
    header_bytes: int    # a repacked unit's scales
    low_bytes: int       # per 32-k block: the low bits' plane
    high_bytes: int      # per 32-k block: the high bits' plane
    zero_point: int      # a weight is d * (code - zero_point) (+ a min)
    num_scales: int      # 16-bit scales from the file block's d on
    legacy: bool         # quant.c's kernel and layout (codes, then scales)

    @property
    def unit_bytes(self) -> int:
        """Bytes of one repacked unit of 32 channels x block_weights."""
        return self.header_bytes + self.block_weights // QK * (self.low_bytes + self.high_bytes)


_ROW = re.compile(r"^\s*X\(([^)]*)\)")


def read_table(header: Path = HEADER) -> dict[str, BlockFormat]:
    """Our format name -> its row, in code order, from the KN_FORMATS macro of `header`."""
    text = header.read_text()
    start = text.index("#define KN_FORMATS(X)")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        match = _ROW.match(line)
        if match:
            gguf_type, name, *numbers = (v.strip() for v in match.group(1).split(","))
            fmt = BlockFormat(gguf_type, name, *map(int, numbers[:-1]), legacy=bool(int(numbers[-1])))
            rows[fmt.name] = fmt
        if not line.rstrip().endswith("\\"):
            break
    if [f.code for f in rows.values()] != list(range(len(rows))):
        raise RuntimeError(f"{header}: KN_FORMATS must list the codes 0, 1, 2... in order")
    return rows


FORMATS: dict[str, BlockFormat] = read_table()
BY_GGUF_TYPE: dict[str, BlockFormat] = {f.gguf_type: f for f in FORMATS.values()}

_COLUMNS = 10   # kn_formats' row (formats.c)


def reported(lib: ctypes.CDLL) -> list[tuple[int, ...]]:
    """The rows a built library reports: code, weights, bytes, acts, header, low, high, zero, scales,
    and where the file block's first scale sits."""
    lib.kn_formats.restype = ctypes.c_int64
    lib.kn_formats.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    values = (ctypes.c_int64 * (64 * _COLUMNS))()
    count = lib.kn_formats(values, len(values))
    return [tuple(values[i * _COLUMNS:(i + 1) * _COLUMNS]) for i in range(max(count, 0))]


def check(lib: ctypes.CDLL) -> None:
    """Raise RuntimeError unless the library was compiled with the table Python read."""
    built = [row[:-1] for row in reported(lib)]
    mine = [(f.code, f.block_weights, f.block_bytes, f.act_group, f.header_bytes, f.low_bytes, f.high_bytes,
             f.zero_point, f.num_scales) for f in FORMATS.values()]
    if built != mine:
        diff = [(f.name, m, b) for f, m, b in zip(FORMATS.values(), mine, built) if m != b]
        raise RuntimeError(f"the C kernels' format table differs from {HEADER.name} as Python reads it "
                           f"({len(built)} rows, {len(mine)} read; name, read, built: {diff})")


def scale_offsets(lib: ctypes.CDLL) -> dict[str, int]:
    """Where each format's file block keeps its first scale, as the compiler laid out block_<name>."""
    return {f.name: row[-1] for f, row in zip(FORMATS.values(), reported(lib))}


def isa_name(lib: ctypes.CDLL) -> str:
    """The quantized kernels' code path in this build: portable, avx2, avx2-vnni or avx512-vnni."""
    lib.kn_isa_name.restype = ctypes.c_char_p
    lib.kn_isa_name.argtypes = []
    return lib.kn_isa_name().decode()
