"""DiskPrefixTier: the prefix cache's second tier, between the block manager and a KVDiskStore.

    after a step:  blocks hashed for the first time --copy (memcpy)--> writer thread --> ROOT/.../<hash>.kv
    on arrival:    a prompt whose next block past its memory hits is on disk is held back from the
                   scheduler while the reader thread reads its blocks (in chain order, to the first miss)
    before a step: a held prompt whose read is done (or has taken _MAX_HOLD_S) gets what was read copied
                   into free blocks, adopted under their hashes, and goes to the scheduler, which then
                   finds them as cached blocks: those tokens are not computed

Every full block goes to the disk once, as soon as it is cached (not when memory evicts it): its copy
then outlives an eviction, a restart and a crash alike, and shutdown has nothing to flush. Neither
the disk writes nor the reads run on the step loop: only memcpys do, so a slow disk turns hits into
misses and never slows a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import Request
from conveyor.model.llama import ModelArch
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.kv.disk import KVDiskStore
from conveyor.runtime.kv.fingerprint import kv_fingerprint, model_digest

logger = logging.getLogger(__name__)

_MAX_HOLD_S = 2.0   # a prompt waits this long at most for its blocks; what is not read by then is computed


@dataclass(slots=True, eq=False)
class _Read:
    """One held prompt's read: the reader appends payloads in chain order and sets `done`."""

    request: Request
    first_block: int                  # index of the first block read: the memory hits end there
    block_hashes: list[bytes]
    started_s: float
    payloads: list[torch.Tensor] = field(default_factory=list)   # uint8, one block's bytes each
    done: bool = False
    cancelled: bool = False
    after: _Read | None = None        # an earlier read of the same chain: this one waits for it, reads nothing


class DiskPrefixTier:
    def __init__(self, store: KVDiskStore, blocks: BlockManager, kv_cache: KVCache,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.blocks, self.kv_cache, self.clock = store, blocks, kv_cache, clock
        blocks.track_new_blocks = True
        self.num_query_tokens = 0    # prompt tokens past the memory hits looked up on disk
        self.held: dict[str, _Read] = {}
        self._reads: queue.Queue[_Read | None] = queue.Queue()
        self._reported = (0, 0, 0, 0)       # take_counts' totals at its last call
        self._read_done = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ reading back

    def hold(self, request: Request) -> bool:
        """Start reading the request's blocks past its memory hits, when the first of them is on disk;
        True if it is held (the engine schedules it once `take_ready` returns it)."""
        size = self.blocks.block_size
        in_memory = self.blocks.find_cached_blocks(request)
        wanted = request.block_hashes[len(in_memory):(request.num_tokens - 1) // size]
        self.num_query_tokens += len(wanted) * size
        if not wanted or not self.store.has(wanted[0]):
            return False
        # Prompts that start alike (a shared system prompt after a restart) read their blocks once.
        same = next((r for r in self.held.values() if r.block_hashes[:1] == wanted[:1]), None)
        if same is not None:
            read = _Read(request, len(in_memory), [], self.clock(), after=same)
        else:
            # What is read waits in memory: never more blocks at once than the KV cache holds.
            room = self.blocks.num_blocks - sum(len(r.block_hashes) for r in self.held.values())
            if room <= 0:
                return False
            read = _Read(request, len(in_memory), wanted[:room], self.clock())
            self._reads.put(read)
        self.held[request.request_id] = read
        return True

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted); False if it is not held."""
        read = self.held.pop(request_id, None)
        if read is None:
            return False
        read.cancelled = True
        return True

    def take_ready(self) -> list[Request]:
        """The held requests whose read is done or overdue, their blocks in memory now, in arrival order."""
        now = self.clock()
        ready = [read for read in self.held.values()
                 if (read.after or read).done or now - read.started_s > _MAX_HOLD_S]
        for read in ready:
            del self.held[read.request.request_id]
            read.cancelled = True
            self._adopt(read, list(read.payloads))
        return [read.request for read in ready]

    def _adopt(self, read: _Read, payloads: list[torch.Tensor]) -> None:
        """Copy what was read into free blocks, unless memory lost the chain's head meanwhile."""
        blocks = self.blocks
        in_memory = blocks.find_cached_blocks(read.request)
        if len(in_memory) < read.first_block:
            return   # a hole before the blocks read: the scheduler would never reach them
        blocks.touch(in_memory)   # so that no block adopted below evicts them
        room = blocks.num_free_blocks - sum(1 for b in in_memory if blocks.ref_counts[b] == 0)
        for block_hash, payload in zip(read.block_hashes[:room], payloads):
            cached = blocks.cached.get(block_hash)
            if cached is not None:   # computed by another request meanwhile
                blocks.touch([cached])
                continue
            block_id = blocks.adopt(block_hash)
            if block_id is None:
                break
            dest = self.kv_cache.tensor[:, :, block_id]    # (L, 2, block_size, H, D); int8: (L, 2, block bytes)
            dest.copy_(payload.view(dest.dtype).view(dest.shape))

    def _read_loop(self) -> None:
        while (read := self._reads.get()) is not None:
            try:
                for block_hash in read.block_hashes:
                    if read.cancelled:
                        break
                    payload = self.store.read(block_hash)
                    if payload is None:
                        break
                    read.payloads.append(torch.tensor(payload))   # the copy off the step loop too
            except Exception:   # a bug costs this prompt its hits, not the reader
                logger.exception("prefix cache: reading blocks back failed")
            finally:
                read.done = True
                self._read_done.set()

    def wait(self, timeout_s: float) -> None:
        """Sleep until a read finishes (or timeout_s): a core with only held requests has nothing to do."""
        if self._read_done.wait(timeout_s):
            self._read_done.clear()

    # ------------------------------------------------------------ writing out

    def save_new_blocks(self) -> None:
        """Queue a copy of each block the last step cached for the first time, unless the disk has it."""
        for block_hash, block_id in self.blocks.take_new_blocks():
            if self.blocks.block_hashes[block_id] != block_hash or self.store.has(block_hash):
                continue
            block = self.kv_cache.tensor[:, :, block_id].to("cpu", copy=True)
            if not self.store.submit(block_hash, block):
                logger.debug("prefix cache: write queue full; a block stays in memory only")

    def take_counts(self) -> tuple[int, int, int, int]:
        """Tokens looked up on disk, tokens read back and used, bytes read, bytes written, since the last
        call (the writer's bytes between two steps count with the later one)."""
        totals = (self.num_query_tokens, self.blocks.num_adopted_hit_tokens, self.store.bytes_read,
                  self.store.bytes_written)
        deltas = tuple(now - before for now, before in zip(totals, self._reported))
        self._reported = totals
        return deltas

    def close(self, timeout_s: float = 5.0) -> None:
        self._reads.put(None)
        self.store.close(timeout_s)


def build_disk_tier(config: EngineConfig, model_path: Path, kv_cache: KVCache, blocks: BlockManager, *,
                    arch: ModelArch, dtype: torch.dtype, quantization: str,
                    kernel_features: frozenset[str] | None, device: torch.device) -> DiskPrefixTier | None:
    """The disk tier the config asks for (None without --prefix-cache-dir); ValueError for a folder that
    others could write (a planted block would be read as this model's KV)."""
    cache = config.cache
    if cache.prefix_cache_dir is None:
        return None
    if config.model.tensor_parallel_size > 1:   # each rank holds a slice of every block
        raise ValueError("prefix_cache_dir does not work with tensor_parallel_size > 1 yet")
    root = Path(cache.prefix_cache_dir).expanduser()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"prefix_cache_dir {root}: {exc}") from exc
    digest = model_digest(model_path, root)
    fingerprint = kv_fingerprint(digest, arch, dtype=dtype, kv_dtype=kv_cache.tensor.dtype, quantization=quantization,
                                 kernel_features=kernel_features, device=device, block_size=kv_cache.block_size,
                                 transposed_keys=kv_cache.transposed_keys,
                                 tensor_parallel_size=config.model.tensor_parallel_size)
    block_nbytes = kv_cache.tensor[:, :, 0].numel() * kv_cache.tensor.element_size()
    store = KVDiskStore.open(root, fingerprint, block_nbytes, cache.prefix_cache_disk_bytes)
    if store is None:
        raise ValueError(f"prefix_cache_dir {root} must be a folder that only this user can write")
    logger.info("prefix cache on disk: %s (%s, up to %.1f GiB)", store.folder, fingerprint.hex()[:12],
                cache.prefix_cache_disk_bytes / 2**30)
    return DiskPrefixTier(store, blocks, kv_cache)
