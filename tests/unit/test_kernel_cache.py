"""The compiled-kernel cache cannot be planted: a library is read only from a folder no other user can
write, and loaded only when its bytes have the digest recorded when it was built. Built from one small
source here (sampling.c) so each build takes a fraction of a second."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conveyor.private_cache import private_dir, read_private_file

build_module = importlib.import_module("conveyor.kernels.build")   # the package re-exports build(), the function
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def _one_small_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_module, "SOURCES", ("sampling.c",))
    monkeypatch.setattr(build_module, "HEADERS", ())


def _build(cache: Path, root: Path | None = None) -> build_module.KernelLibrary:
    built = build_module.build(frozenset(), cache_dir=cache, cache_root=root)
    assert built is not None and hasattr(built.lib, "mask_logits")
    return built


def _planted(folder: Path, marker: Path) -> None:
    """A library whose constructor leaves `marker`, at the name the cache would look up, with a
    matching digest beside it: what another user could plant in a shared folder."""
    target = _build(folder.parent / "reference").path   # the name the key gives
    source = folder / "evil.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                      f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
                      'void mask_logits(void) {}\n')
    planted = folder / target.name
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(planted), str(source)], check=True)
    (folder / (target.name + ".sha256")).write_text(hashlib.sha256(planted.read_bytes()).hexdigest() + "\n")


def test_a_private_cache_is_built_once_then_read_back(tmp_path: Path) -> None:
    first = _build(tmp_path / "cache")
    assert first.path.parent == tmp_path / "cache" and first.path.is_file()
    recorded = (first.path.parent / (first.path.name + ".sha256")).read_text().strip()
    assert recorded == hashlib.sha256(first.path.read_bytes()).hexdigest()
    assert _build(tmp_path / "cache").path == first.path
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("why", ["world-writable", "group-writable", "symlink", "writable-parent"])
def test_a_folder_others_can_write_is_never_read(tmp_path: Path, why: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "reference").mkdir()
    marker = tmp_path / "constructor-ran"
    _planted(shared, marker)
    cache, root = shared, None
    if why == "world-writable":
        shared.chmod(0o1777)
    elif why == "group-writable":
        shared.chmod(0o770)
    elif why == "symlink":
        cache = tmp_path / "link"
        cache.symlink_to(shared)
    else:   # the cache folder itself is private, one above it is not
        os.chmod(tmp_path, 0o777)
        cache, root = shared, tmp_path
        shared.chmod(0o700)
    built = _build(cache, root)
    assert not marker.exists(), "a planted library's constructor ran"
    assert shared not in built.path.parents and not built.path.exists()   # a private folder, removed after


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_never_read(tmp_path: Path) -> None:
    shared = tmp_path / "theirs"
    shared.mkdir()
    (tmp_path / "reference").mkdir()
    marker = tmp_path / "constructor-ran"
    _planted(shared, marker)
    os.chown(shared, 65534, 65534)
    shared.chmod(0o755)
    _build(shared)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "one-byte-changed", "no-digest", "digest-edited", "fifo"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    target = _build(cache).path
    sidecar = target.with_name(target.name + ".sha256")
    data = target.read_bytes()
    target.rename(target.with_name("loaded-here"))   # a new file: this process keeps its mapping of the old one
    target.write_bytes(data)
    if damage == "truncated":   # loaded, this faults (SIGBUS) on the first call
        target.write_bytes(data[: len(data) // 3])
    elif damage == "one-byte-changed":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "no-digest":
        sidecar.unlink()
    elif damage == "digest-edited":
        sidecar.write_text("0" * 64 + "\n")
    else:
        target.unlink()
        os.mkfifo(target)
    rebuilt = _build(cache)
    assert rebuilt.path == target and target.read_bytes() == data
    assert sidecar.read_text().strip() == hashlib.sha256(data).hexdigest()


def test_private_dir_creates_missing_folders_owner_only(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "a" / "b", tmp_path)
    assert made == tmp_path / "a" / "b"
    assert all((tmp_path / p).stat().st_mode & 0o777 == 0o700 for p in ("a", "a/b"))


def test_read_private_file_refuses_what_is_not_a_plain_private_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 10)
    plain.chmod(0o600)
    assert read_private_file(plain, 10) == b"x" * 10
    assert read_private_file(plain, 9) is None                 # larger than allowed
    plain.chmod(0o666)
    assert read_private_file(plain, 10) is None                # others may write it
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_private_file(fifo, 10) is None                 # and it did not block
    link = tmp_path / "link"
    link.symlink_to(plain)
    assert read_private_file(link, 10) is None
