"""The fast GGUF metadata reader gives what gguf's own `GGUFReader` gives, for every value type, in
both byte orders, and refuses cut-short or foreign files with a ValueError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conveyor.model.gguf.metadata import read_gguf_metadata

gguf = pytest.importorskip("gguf")

STRINGS = ["", "a", "Ġthe", "日本語", "👩‍👩‍👧", "tab\there", "x" * 300, "ĊĊ", "\"quoted\\"]


def _write(path: Path, *, big_endian: bool = False, strings: list[str] = STRINGS) -> Path:
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), arch="llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", -2.25e-300)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_string("t.str", "héllo wörld")
    w.add_string("t.empty", "")
    w.add_array("t.strs", strings)
    w.add_array("t.empty_strs", [])
    w.add_array("t.ints", [3, -1, 4, 1, -5])
    w.add_array("t.floats", [0.5, 1.25, -3.0])
    w.add_array("t.bools", [True, False, True])
    w.add_tensor("w", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _plain(value: object) -> object:
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("big_endian", [False, True])
def test_every_key_matches_gguf_reader(tmp_path: Path, big_endian: bool) -> None:
    path = _write(tmp_path / "m.gguf", big_endian=big_endian)
    ours = read_gguf_metadata(path)
    reference = _reference(path)
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        assert _plain(ours[key]) == value, key
        assert type(_plain(ours[key])) is type(value), key
    assert isinstance(ours["t.ints"], np.ndarray) and ours["t.ints"].dtype.isnative


def test_only_the_asked_keys_are_returned(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    ours = read_gguf_metadata(path, ["t.strs", "t.f64", "not.there"])
    assert ours == {"t.strs": STRINGS, "t.f64": -2.25e-300}


def test_strings_holding_nul_bytes_are_read_whole(tmp_path: Path) -> None:
    # NUL is the separator of the one-decode path: a string holding one takes the per-string path.
    strings = ["a\x00b", "", "\x00", "c"]
    path = _write(tmp_path / "m.gguf", strings=strings)
    assert read_gguf_metadata(path, ["t.strs"])["t.strs"] == strings


def test_invalid_utf8_is_a_value_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", strings=["ok", "zz"])
    data = bytearray(path.read_bytes())
    data[data.index(b"zz")] = 0xFF  # a byte that never occurs in UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        read_gguf_metadata(path, ["t.strs"])


def test_a_cut_short_file_is_a_value_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = data.index("Ġthe".encode()) + 2  # inside the string array
    (tmp_path / "short.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError):
        read_gguf_metadata(tmp_path / "short.gguf")


def test_a_foreign_file_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="GGUF magic"):
        read_gguf_metadata(tmp_path / "x.gguf")
