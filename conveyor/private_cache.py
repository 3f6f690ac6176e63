"""Folders whose files a later start trusts (compiled kernels, derived tokenizer merges), used only
when no other user can have put anything there, and files read from them only when they are plain
files: another user's planted library would run as us, and a FIFO would hang the start.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path


CACHE_ROOT = Path.home() / ".cache"


def private_dir(path: Path, root: Path | None = None) -> Path | None:
    """`path`, created (mode 0700) where missing, when every folder from `root` down to it is a real
    directory (no symlink) owned by this user and writable by no group or other user; else None.
    `root` is `path` or one of its parents (by default ~/.cache for a folder under it, else `path`)."""
    path = Path(os.path.abspath(path))
    if root is None:
        root = CACHE_ROOT if CACHE_ROOT in path.parents else path
    root = Path(os.path.abspath(root))
    if path != root and root not in path.parents:
        raise ValueError(f"{root} is not a parent of {path}")
    chain = [root, *reversed([p for p in path.parents if root in p.parents]), path] if path != root else [root]
    for folder in chain:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
        try:
            info = os.lstat(folder)
        except OSError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return None
    return path


def read_private_file(path: Path, max_bytes: int) -> bytes | None:
    """A plain file's bytes (no symlink, FIFO or device; never blocks), when this user owns it, no one
    else can write it, and it holds at most `max_bytes`; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022 \
                or info.st_size > max_bytes:
            return None
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                return None   # shrank while read: a half-written file
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, fsync: bool = False) -> None:
    """`data` at `path`, whole or not at all for any reader, whoever else writes it (raises OSError).
    With `fsync`, on the disk before it is renamed into place, so a crash leaves no torn file either."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    except OSError:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
