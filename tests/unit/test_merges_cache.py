"""The SentencePiece merges cache is input: a reordered, edited, oversized or planted file, a FIFO or a
folder others can write means the merges are derived again, never wrong token ids or a hung start."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from conveyor.text.gguf_spm import cached_spm_merges, spm_merges

TOKENS = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca"]
VOCAB = {t: i for i, t in enumerate(TOKENS)}
SCORES = np.array([0, 0, 0, -3, -1, -2, -5, -4, -6], dtype=np.float32)
WANT = spm_merges(TOKENS, VOCAB, SCORES)
HEADER = struct.Struct("<16sQ32s")


def _derive(folder: Path) -> list[tuple[str, str]]:
    return cached_spm_merges(TOKENS, VOCAB, SCORES, folder)


def _cached(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "tokenizers"
    assert _derive(folder) == WANT
    (path,) = folder.iterdir()
    return folder, path


def _rewrite(path: Path, pairs: np.ndarray, rows: int | None = None, digest: bytes | None = None) -> None:
    magic = path.read_bytes()[:16]
    payload = np.ascontiguousarray(pairs, dtype="<i4").tobytes()
    header = HEADER.pack(magic, len(pairs) if rows is None else rows, digest or hashlib.sha256(payload).digest())
    path.write_bytes(header + payload)


def _pairs(path: Path) -> np.ndarray:
    """(left, right, merged) token ids per row."""
    return np.frombuffer(path.read_bytes()[HEADER.size:], dtype="<i4").reshape(-1, 3).copy()


def test_the_cache_reads_back_what_was_derived(tmp_path: Path) -> None:
    folder, path = _cached(tmp_path)
    assert len(WANT) >= 4 and _derive(folder) == WANT
    assert path.stat().st_mode & 0o777 == 0o600 and folder.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("edit", ["reordered", "reordered-same-digest", "pair-changed", "pair-not-a-token",
                                  "id-out-of-range", "row-dropped", "rows-2^36", "truncated", "empty"])
def test_a_damaged_cache_file_is_derived_again(tmp_path: Path, edit: str) -> None:
    folder, path = _cached(tmp_path)
    pairs = _pairs(path)
    original = path.read_bytes()
    if edit == "reordered":            # a well-formed file in another order: the ids it gives are wrong
        _rewrite(path, pairs[::-1])
    elif edit == "reordered-same-digest":
        _rewrite(path, pairs[::-1], digest=original[24:56])
    elif edit == "pair-changed":       # another real merge in the first slot
        pairs[0] = pairs[-1]
        _rewrite(path, pairs)
    elif edit == "pair-not-a-token":   # "c" + "c" is no token, let alone "bc"
        pairs[0] = (VOCAB["c"], VOCAB["c"], VOCAB["bc"])
        _rewrite(path, pairs)
    elif edit == "id-out-of-range":
        pairs[1, 0] = 10**6
        _rewrite(path, pairs)
    elif edit == "row-dropped":        # the digest of the whole list no longer matches
        _rewrite(path, pairs[:-1], digest=original[24:56])
    elif edit == "rows-2^36":          # a header claiming far more rows than the vocabulary can split into
        _rewrite(path, pairs, rows=1 << 36)
    elif edit == "truncated":
        path.write_bytes(original[: len(original) - 5])
    else:
        path.write_bytes(b"")
    assert _derive(folder) == WANT
    assert path.read_bytes() == original   # derived again and rewritten whole


def test_a_fifo_at_the_cache_path_does_not_hang_the_start(tmp_path: Path) -> None:
    folder, path = _cached(tmp_path)
    path.unlink()
    os.mkfifo(path)
    result: list[list[tuple[str, str]]] = []
    reader = threading.Thread(target=lambda: result.append(_derive(folder)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():   # unblock it, so the test process can end
        open(path, "wb").close()
        pytest.fail("reading the merges cache blocked on a FIFO")
    assert result == [WANT] and path.is_file()


@pytest.mark.parametrize("why", ["world-writable", "symlinked-file", "another-user"])
def test_a_cache_others_could_have_written_is_not_read(tmp_path: Path, why: str) -> None:
    folder, path = _cached(tmp_path)
    pairs = _pairs(path)
    # Planted: one merge left out and the digest made to match, which only the folder's owner could do.
    _rewrite(path, pairs[:-1])
    assert _derive(folder) == WANT[:-1]   # (read from a private folder, it would be believed)
    planted = path.read_bytes()
    if why == "world-writable":
        folder.chmod(0o777)
    elif why == "symlinked-file":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(planted)
        path.unlink()
        path.symlink_to(elsewhere)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    assert _derive(folder) == WANT
