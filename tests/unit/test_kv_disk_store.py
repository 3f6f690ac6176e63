"""KVDiskStore on real files in tmp_path: round trip, every kind of bad file a miss, the size bound, sharing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from conveyor.runtime.kv.disk import KVDiskStore

SHAPE = (2, 2, 4, 1, 8)            # (layers, K/V, block_size, kv heads, head dim)
NBYTES = 2 * 2 * 4 * 1 * 8 * 2     # float16
FINGERPRINT = bytes(range(32))


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def open_store(root: Path, max_bytes: int = 1 << 30, fingerprint: bytes = FINGERPRINT) -> KVDiskStore:
    store = KVDiskStore.open(root, fingerprint, NBYTES, max_bytes)
    assert store is not None
    return store


def write(store: KVDiskStore, *indices: int) -> None:
    for i in indices:
        assert store.submit(key(i), block(i))
    assert store.flush(10)


def as_block(payload) -> torch.Tensor:  # noqa: ANN001
    return torch.tensor(payload).view(torch.float16).view(SHAPE)


def test_round_trip_and_restart(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert store.read(key(1)) is None
    write(store, 1, 2)
    assert torch.equal(as_block(store.read(key(1))), block(1))
    store.close()
    again = open_store(tmp_path)   # a restart finds them
    assert torch.equal(as_block(again.read(key(2))), block(2))
    assert again.bytes_read > NBYTES and store.bytes_written > 2 * NBYTES
    again.close()
    mode = os.stat(store.path_for(key(1))).st_mode & 0o777
    assert mode == 0o600 and os.stat(store.folder).st_mode & 0o777 == 0o700


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def damage_grow(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def damage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8] ^= 1   # first byte of the recorded fingerprint: another model's block
    path.write_bytes(bytes(data))


def damage_empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [damage_flip, damage_truncate, damage_grow, damage_header, damage_empty])
def test_damaged_file_is_a_miss_and_is_removed(tmp_path: Path, damage) -> None:  # noqa: ANN001
    store = open_store(tmp_path)
    write(store, 1)
    path = store.path_for(key(1))
    damage(path)
    os.chmod(path, 0o600)
    assert store.read(key(1)) is None
    if damage is not damage_grow:   # too long to be read at all: left for trimming
        assert not path.exists() and store.num_bad_files == 1
    assert store.read(key(1)) is None
    store.close()


def test_file_under_another_name_is_a_miss(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, 1)
    os.replace(store.path_for(key(1)), store.path_for(key(9)))   # the header names block 1
    assert store.read(key(9)) is None
    store.close()


def test_untrusted_files_and_folders_are_misses(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, 1, 2)
    os.chmod(store.path_for(key(1)), 0o666)      # anyone could have written it
    assert store.read(key(1)) is None
    os.unlink(store.path_for(key(2)))
    os.mkfifo(store.path_for(key(2)))            # a FIFO never blocks a read
    assert store.read(key(2)) is None
    store.close()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert KVDiskStore.open(shared, FINGERPRINT, NBYTES, 1 << 30) is None


def test_other_fingerprint_lives_apart(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, 1)
    other = open_store(tmp_path, fingerprint=bytes(32))
    assert other.folder != store.folder and other.read(key(1)) is None
    store.close()
    other.close()


def test_size_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    file_bytes = NBYTES + 84
    store = open_store(tmp_path, max_bytes=5 * file_bytes)
    for i in range(5):
        write(store, i)
        os.utime(store.path_for(key(i)), (time.time() - 100 + i,) * 2)
    assert store.read(key(0)) is not None   # read: now the most recently used
    write(store, 5)                          # over the bound: trimmed to 90 %
    left = sorted(int(p.stem, 16) for p in store.folder.glob("*.kv"))
    assert left == [0, 3, 4, 5]
    (store.folder / "named").mkdir(mode=0o700)   # a named prompt keeps block 3
    (store.folder / "named" / "keep.json").write_text(json.dumps(
        {"version": 1, "token_ids": [1, 2], "blocks": [store.path_for(key(3)).name]}))
    write(store, 6, 7)
    left = sorted(int(p.stem, 16) for p in store.folder.glob("*.kv"))
    assert 3 in left and len(left) <= 4
    store.close()


def test_two_stores_share_a_folder(tmp_path: Path) -> None:
    file_bytes = NBYTES + 84
    a, b = open_store(tmp_path, max_bytes=20 * file_bytes), open_store(tmp_path, max_bytes=20 * file_bytes)
    for i in range(40):    # both write the same blocks and trim each other's files
        a.submit(key(i), block(i))
        b.submit(key(i), block(i))
        b.submit(key(100 + i), block(100 + i))
    assert a.flush(30) and b.flush(30)
    names = list(a.folder.glob("*.kv"))
    # Each store counts its own writes between scans: the other's since its last scan may overshoot a little.
    assert 0 < len(names) <= 25 and not list(a.folder.glob(".*.tmp"))
    for path in names:
        i = int(path.stem, 16)
        payload = a.read(key(i))
        assert payload is not None and torch.equal(as_block(payload), block(i))
    a.close()
    b.close()


def test_model_digest_sees_a_swapped_file_of_the_same_size_and_mtime(tmp_path: Path) -> None:
    from conveyor.runtime.kv.fingerprint import model_digest

    model = tmp_path / "model.gguf"
    model.write_bytes(b"A" * 4096)
    info = model.stat()
    first = model_digest(model, tmp_path / "kv")
    assert model_digest(model, tmp_path / "kv") == first and len(list((tmp_path / "kv" / "digests").iterdir())) == 1
    model.write_bytes(b"B" * 4096)
    os.utime(model, ns=(info.st_atime_ns, info.st_mtime_ns))   # same name, size and mtime
    assert model_digest(model, tmp_path / "kv") != first


def test_a_failed_write_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    path = store.path_for(key(1))
    # Where the writer's temporary file would go stands a folder: the write fails as on a full disk.
    (store.folder / f".{path.name}.{os.getpid()}.{store._thread.ident}.tmp").mkdir()
    write(store, 1, 2)
    assert store.num_failed_writes == 1 and store.read(key(1)) is None
    assert torch.equal(as_block(store.read(key(2))), block(2))
    store.close()
