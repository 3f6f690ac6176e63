"""KVDiskStore: full KV blocks as files in a folder, found by the prefix cache's chained block hash.

    ROOT/<fingerprint>/<block hash>.kv       one block: header + raw KV bytes, (L, 2, block_size, H, D)
                                             (int8: (L, 2, block bytes), codes and scales; kv_quant.py)
    ROOT/<fingerprint>/named/<name>.json     a named prompt (named_prompts.py): its blocks are kept

A file is input (STYLE.md section 11): it is used only when it is a plain file of this user's that
no one else can write, of exactly the expected size, and its header names this model's fingerprint
and the hash asked for, and its checksum holds. Anything else is a miss (and the file is removed).
Writes run on one thread of their own, each to a temporary file that is flushed to the disk before
it is renamed into place, so a reader, a crash or a second server on the same folder never sees half
a block. The folder is kept under `max_bytes` by removing the least recently used files (by mtime:
a read touches its file), rescanned now and then, so files another server adds or removes count.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from pathlib import Path

import numpy as np
import torch

from conveyor.private_cache import private_dir, read_private_file, write_atomically
from conveyor.runtime.kv.named_prompts import BLOCK_SUFFIX, block_file_name, pinned_files

logger = logging.getLogger(__name__)

_MAGIC = b"CVKVBLK1"
# magic, fingerprint, block hash, payload bytes, crc32 of the payload
_HEADER = struct.Struct("<8s32s32sQI")
_TRIM_TO = 0.9                    # of max_bytes, so a full folder is not rescanned on every write
_RESCAN_S = 30.0                  # another server's files count within this long
_STALE_PARTIAL_S = 600.0          # a temporary file this old belongs to a writer that died


class KVDiskStore:
    def __init__(self, folder: Path, fingerprint: bytes, block_nbytes: int, max_bytes: int,
                 max_queued_bytes: int = 256 * 2**20) -> None:
        """`folder` is private (private_dir) and holds this fingerprint's blocks; its parent is the root
        the size bound covers."""
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes")
        self.folder, self.root = folder, folder.parent
        self.fingerprint, self.block_nbytes, self.max_bytes = fingerprint, block_nbytes, max_bytes
        self.max_queued_bytes = max_queued_bytes
        self.bytes_written = 0            # totals since start, for the metrics
        self.bytes_read = 0
        self.num_dropped = 0              # blocks not written: the queue was full (a slow disk)
        self.num_bad_files = 0            # files refused on read
        self.num_failed_writes = 0
        self._queue: queue.Queue[tuple[bytes, torch.Tensor, torch.cuda.Event | None] | None] = queue.Queue()
        self._queued_bytes = 0
        self._idle = threading.Condition()
        self._pending = 0
        self._total_bytes, self._scanned_at = self._trim(), time.monotonic()
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()
        atexit.register(_flush_at_exit, weakref.ref(self))   # an offline script's last blocks reach the disk

    @classmethod
    def open(cls, root: Path, fingerprint: bytes, block_nbytes: int, max_bytes: int) -> KVDiskStore | None:
        """The store in `root`, or None when the folder is not private to this user."""
        folder = private_dir(root / fingerprint.hex()[:32], root=root)
        return None if folder is None else cls(folder, fingerprint, block_nbytes, max_bytes)

    def path_for(self, block_hash: bytes) -> Path:
        return self.folder / block_file_name(block_hash)

    def has(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path_for(block_hash))

    # ------------------------------------------------------------ reading

    def read(self, block_hash: bytes) -> np.ndarray | None:
        """The block's KV bytes (uint8, read-only), or None for a miss of any kind."""
        path = self.path_for(block_hash)
        data = read_private_file(path, _HEADER.size + self.block_nbytes)
        if data is None:
            return None   # absent (or not a file we trust)
        payload = self._check(data, block_hash)
        if payload is None:
            self.num_bad_files += 1
            logger.warning("prefix cache file %s is damaged or not this model's: ignored and removed", path.name)
            _unlink(path)
            return None
        try:
            os.utime(path)   # recently used: trimmed last
        except OSError:
            pass
        self.bytes_read += len(data)
        return payload

    def _check(self, data: bytes, block_hash: bytes) -> np.ndarray | None:
        if len(data) != _HEADER.size + self.block_nbytes:
            return None
        magic, fingerprint, recorded_hash, size, crc = _HEADER.unpack_from(data)
        if (magic != _MAGIC or fingerprint != self.fingerprint or recorded_hash != block_hash
                or size != self.block_nbytes):
            return None
        payload = np.frombuffer(data, dtype=np.uint8, offset=_HEADER.size)
        return payload if zlib.crc32(payload) == crc else None

    # ------------------------------------------------------------ writing

    def submit(self, block_hash: bytes, block: torch.Tensor, ready: torch.cuda.Event | None = None) -> bool:
        """Queue a copy of one block's KV (a CPU tensor nobody writes again; its bytes are there once
        `ready` is done, the event of a copy from a GPU) for writing; False when the queue is full, so a
        slow disk costs hits later, never a step now."""
        nbytes = block.numel() * block.element_size()
        if nbytes != self.block_nbytes:
            raise ValueError(f"a block of {nbytes} bytes, expected {self.block_nbytes}")
        with self._idle:
            if self._queued_bytes + nbytes > self.max_queued_bytes:
                self.num_dropped += 1
                return False
            self._queued_bytes += nbytes
            self._pending += 1
        self._queue.put((block_hash, block, ready))
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block is written (or dropped on an error); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most `timeout_s`), then stop the writer."""
        if not self.flush(timeout_s):
            logger.warning("prefix cache: %d blocks were still queued for the disk at shutdown", self._pending)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            block_hash, block, ready = item
            try:
                if ready is not None:
                    ready.synchronize()   # this thread waits for the copy, never the step loop
                self._write(block_hash, block)
            except OSError as exc:   # a full or failing disk: this block stays in memory only
                self.num_failed_writes += 1
                if self.num_failed_writes in (1, 10, 100) or self.num_failed_writes % 1000 == 0:
                    logger.warning("prefix cache: writing a block failed (%d so far): %s", self.num_failed_writes, exc)
            except Exception:   # a bug fails this block, not the writer
                logger.exception("prefix cache: writing a block failed")
            finally:
                with self._idle:
                    self._queued_bytes -= self.block_nbytes
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, block_hash: bytes, block: torch.Tensor) -> None:
        path = self.path_for(block_hash)
        if os.path.exists(path):
            return   # written before, or by another server on the same folder
        payload = block.contiguous().view(torch.uint8).reshape(-1).numpy()
        header = _HEADER.pack(_MAGIC, self.fingerprint, block_hash, payload.nbytes, zlib.crc32(payload))
        write_atomically(path, header + payload.tobytes(), fsync=True)
        size = _HEADER.size + payload.nbytes
        self.bytes_written += size
        self._total_bytes += size
        if self._total_bytes > self.max_bytes or time.monotonic() - self._scanned_at > _RESCAN_S:
            self._total_bytes, self._scanned_at = self._trim(), time.monotonic()

    # ------------------------------------------------------------ the size bound

    def _trim(self) -> int:
        """Remove the least recently used block files under the root until they fit; returns the bytes left."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for path in self.root.glob(f"*/*{BLOCK_SUFFIX}"):
            try:
                info = path.lstat()
            except OSError:
                continue   # removed by another server meanwhile
            files.append((info.st_mtime, info.st_size, path))
        for partial in self.root.glob("*/.*.tmp"):
            try:
                if now - partial.lstat().st_mtime > _STALE_PARTIAL_S:
                    _unlink(partial)
            except OSError:
                continue
        total = sum(size for _, size, _ in files)
        if total <= self.max_bytes:
            return total
        files.sort()
        pinned = {folder: pinned_files(folder) for folder in {path.parent for _, _, path in files}}
        for _, size, path in files:
            if total <= _TRIM_TO * self.max_bytes:
                break
            if path.name in pinned[path.parent]:
                continue
            _unlink(path)
            total -= size
        return total


def _flush_at_exit(ref: weakref.ref[KVDiskStore]) -> None:
    store = ref()
    if store is not None:
        store.flush(5.0)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass   # already gone: another server trimmed it
