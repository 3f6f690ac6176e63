"""Start-up work done once: the KV cache is zero without writing it (an anonymous mapping), and a GGUF
file's metadata is parsed once for the weights and the tokenizer, again only when the file changes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.model.gguf.model import gguf_reader
from conveyor.runtime.kv.cache import _zeros

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_starts_zeroed_and_writable(dtype: torch.dtype) -> None:
    tensor = _zeros((3, 2, 5, 4), dtype, torch.device("cpu"))
    assert tensor.dtype == dtype and tensor.shape == (3, 2, 5, 4) and not tensor.any()
    tensor[1, 0, 2] = 1.5
    assert tensor.sum().item() == pytest.approx(1.5 * 4)
    assert tensor.data_ptr() % 4096 == 0   # page-aligned, as the kernels' vector loads like it


def write_gguf(path: Path, value: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("t", np.zeros((4,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_is_parsed_once_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, 1)
    first = gguf_reader(path)
    assert gguf_reader(path) is first
    write_gguf(path, 22)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # a rewrite within the clock's tick
    second = gguf_reader(path)
    assert second is not first and second.fields["test.value"].contents() == 22
