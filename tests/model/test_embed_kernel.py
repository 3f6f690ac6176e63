"""embed.c's token-table lookups give gguf.quants.dequantize's rows bit for bit, on every code path this
CPU can run, and refuse ids outside the table."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.kernels import quant

from kernel_builds import VARIANTS
from kernel_builds import library as build_for

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")
TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q5_0": gguf.GGMLQuantizationType.Q5_0}


def _table(fmt: str, rows: int, k: int) -> np.ndarray:
    w = np.random.default_rng(rows + k).standard_normal((rows, k)).astype(np.float32)
    w[3] = 0.0                      # a block whose scale is zero
    w[5, :32] *= 1000.0             # an outlier block
    return gguf.quants.quantize(w, TYPES[fmt])   # (rows, bytes per row) uint8


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", quant.EMBED_FORMATS)
def test_lookup_matches_gguf_dequantize(variant: str, fmt: str) -> None:
    library = build_for(variant)
    k = 96
    table = _table(fmt, 40, k)
    ids = torch.tensor([0, 39, 3, 5, 17, 5])
    got = quant.embed_rows(library, fmt, table.ctypes.data, table.shape[0], table.shape[1], ids, k)
    want = torch.from_numpy(gguf.quants.dequantize(table[ids.numpy()], TYPES[fmt]))
    assert got.shape == (6, k) and torch.equal(got, want)
    assert quant.embed_rows(library, fmt, table.ctypes.data, 40, table.shape[1], ids[:0], k).shape == (0, k)


def test_lookup_refuses_ids_outside_the_table_and_a_wrong_row_size() -> None:
    library = kernels.library()
    table = _table("q8_0", 8, 64)
    for bad in (8, -1):
        with pytest.raises(IndexError, match="outside the embedding table"):
            quant.embed_rows(library, "q8_0", table.ctypes.data, 8, table.shape[1], torch.tensor([0, bad]), 64)
    with pytest.raises(ValueError, match="refused"):
        quant.embed_rows(library, "q8_0", table.ctypes.data, 8, table.shape[1] - 1, torch.tensor([0]), 64)
