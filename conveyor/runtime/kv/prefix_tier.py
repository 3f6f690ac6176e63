"""PrefixTiers: the prefix cache's second tiers behind the block manager: host memory
(host_tier.py, --prefix-cache-host-size) in front of a KVDiskStore (--prefix-cache-dir), either or both.

    after a step:  blocks hashed for the first time --copy--> host memory --> writer thread --> ROOT/.../<hash>.kv
                   (without host memory: --copy (memcpy)--> writer thread)
    on arrival:    a prompt's blocks past its memory hits that host memory holds are copied into free blocks
                   at once; if the chain goes on on disk, the prompt is held back from the scheduler while
                   the reader thread reads the rest (in chain order, to the first miss)
    before a step: a held prompt whose read is done (or has taken _MAX_HOLD_S) gets what was read copied
                   into free blocks, adopted under their hashes, and goes to the scheduler, which then
                   finds them as cached blocks: those tokens are not computed

Every full block goes to the disk once, as soon as it is cached (not when memory evicts it): its copy
then outlives an eviction, a restart and a crash alike, and shutdown has nothing to flush. Neither
the disk writes nor the reads run on the step loop: only memory copies do, so a slow disk turns hits
into misses and never slows a step.
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
from conveyor.config_values import parse_bytes
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import Request
from conveyor.model.llama import ModelArch
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.kv.disk import KVDiskStore
from conveyor.runtime.kv.fingerprint import kv_fingerprint, model_digest
from conveyor.runtime.kv.host_tier import HostKVTier

logger = logging.getLogger(__name__)

_MAX_HOLD_S = 2.0   # a prompt waits this long at most for its blocks; what is not read by then is computed


@dataclass(slots=True, eq=False)
class _Read:
    """One held prompt's read: the reader appends payloads in chain order and sets `done`."""

    request: Request
    first_block: int                  # index of the first block read: the memory and host hits end there
    block_hashes: list[bytes]
    started_s: float
    payloads: list[torch.Tensor] = field(default_factory=list)   # uint8, one block's bytes each
    done: bool = False
    cancelled: bool = False
    after: _Read | None = None        # an earlier read of the same chain: this one waits for it, reads nothing


class PrefixTiers:
    def __init__(self, store: KVDiskStore | None, blocks: BlockManager, kv_cache: KVCache,
                 clock: Callable[[], float] = time.monotonic, host: HostKVTier | None = None) -> None:
        self.store, self.blocks, self.kv_cache, self.clock, self.host = store, blocks, kv_cache, clock, host
        blocks.track_new_blocks = True
        self.num_query_tokens = 0         # prompt tokens past the memory and host hits looked up on disk
        self.num_host_query_tokens = 0    # prompt tokens past the memory hits looked up in host memory
        self.held: dict[str, _Read] = {}
        self._reads: queue.Queue[_Read | None] = queue.Queue()
        self._reported = (0,) * 8       # take_counts' totals at its last call
        self._read_done = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._reader.start()

    @property
    def folder(self) -> str:
        """The disk's folder for this model's blocks and named prompts; "" without a disk."""
        return str(self.store.folder) if self.store is not None else ""

    # ------------------------------------------------------------ reading back

    def hold(self, request: Request) -> bool:
        """Copy the request's blocks past its memory hits in from host memory, then start reading the
        rest of the chain when its next block is on disk; True if it is held (the engine schedules it
        once `take_ready` returns it)."""
        size = self.blocks.block_size
        in_memory = self.blocks.find_cached_blocks(request)
        wanted = request.block_hashes[len(in_memory):(request.num_tokens - 1) // size]
        num_in_host = 0
        if self.host is not None:
            self.host.touch(request.block_hashes[:len(in_memory)])
            self.num_host_query_tokens += len(wanted) * size
            num_in_host = self.host.num_leading(wanted)
        on_disk = wanted[num_in_host:]
        first_block = len(in_memory) + num_in_host
        if self.store is not None:
            self.num_query_tokens += len(on_disk) * size
        if self.store is None or not on_disk or not self.store.has(on_disk[0]):
            if num_in_host:
                self._adopt(request, first_block, [])
            return False
        # Prompts that start alike (a shared system prompt after a restart) read their blocks once.
        same = next((r for r in self.held.values() if r.block_hashes[:1] == on_disk[:1]), None)
        if same is not None:
            read = _Read(request, first_block, [], self.clock(), after=same)
        else:
            # What is read waits in memory: never more blocks at once than the KV cache holds.
            room = self.blocks.num_blocks - sum(len(r.block_hashes) for r in self.held.values())
            if room <= 0:
                if num_in_host:
                    self._adopt(request, first_block, [])
                return False
            read = _Read(request, first_block, on_disk[:room], self.clock())
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
            self._adopt(read.request, read.first_block, list(read.payloads))
        return [read.request for read in ready]

    def _adopt(self, request: Request, first_block: int, payloads: list[torch.Tensor]) -> None:
        """Copy the request's chain past its memory hits into free blocks, in chain order to the first block
        found nowhere: from host memory, else from `payloads`, read from disk for the blocks from
        `first_block` on. A hole before them (host memory or memory lost a block meanwhile) ends it there."""
        blocks, host = self.blocks, self.host
        in_memory = blocks.find_cached_blocks(request)
        blocks.touch(in_memory)   # so that no block adopted below evicts them
        room = blocks.num_free_blocks - sum(1 for b in in_memory if blocks.ref_counts[b] == 0)
        for index in range(len(in_memory), first_block + len(payloads)):
            block_hash = request.block_hashes[index]
            cached = blocks.cached.get(block_hash)
            if cached is not None:   # computed by another request meanwhile
                blocks.touch([cached])
                continue
            buffer = host.get(block_hash) if host is not None else None
            payload = buffer if buffer is not None else payloads[index - first_block] if index >= first_block else None
            if payload is None or room <= 0 or (block_id := blocks.adopt(block_hash, buffer is not None)) is None:
                break
            room -= 1
            dest = self.kv_cache.tensor[:, :, block_id]    # (L, 2, block_size, H, D); int8: (L, 2, block bytes)
            if buffer is not None:
                host.copy_in(buffer, dest)
            else:
                dest.copy_(payload.view(dest.dtype).view(dest.shape))
                if host is not None:   # read from disk once: a later eviction from memory falls back to host
                    host.put(block_hash, payload.reshape(-1))

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
        """Copy each block the last step cached for the first time out to host memory, and queue it for
        the disk, unless the disk has it."""
        new = [(block_hash, block_id) for block_hash, block_id in self.blocks.take_new_blocks()
               if self.blocks.block_hashes[block_id] == block_hash]
        ready = None
        if self.host is not None:   # the disk writer reads host memory's copy (once `ready`): no second one
            copies, ready = self.host.copy_out(self.kv_cache.tensor, new)
            if self.store is None:
                return
            copies = [(block_hash, block) for block_hash, block in copies if not self.store.has(block_hash)]
        else:
            tensor = self.kv_cache.tensor
            copies = [(block_hash, tensor[:, :, block_id].to("cpu", copy=True)) for block_hash, block_id in new
                      if not self.store.has(block_hash)]
        for block_hash, block in copies:   # each block's file looked up once (a stat on the step loop)
            if not self.store.submit(block_hash, block, ready):
                logger.debug("prefix cache: write queue full; a block stays in memory only")

    def take_counts(self) -> tuple[tuple[int, int, int, int] | None, tuple[int, int, int, int, int] | None]:
        """Since the last call, on disk (None without one): tokens looked up, tokens read back and used, bytes
        read, bytes written (the writer's bytes between two steps count with the later one); in host memory
        (None without it): tokens looked up, tokens copied back and used, bytes copied in, bytes copied
        out, and the bytes it holds now."""
        blocks, store, host = self.blocks, self.store, self.host
        totals = (self.num_query_tokens, blocks.num_adopted_hit_tokens - blocks.num_host_hit_tokens,
                  store.bytes_read if store else 0, store.bytes_written if store else 0,
                  self.num_host_query_tokens, blocks.num_host_hit_tokens, host.bytes_read if host else 0,
                  host.bytes_written if host else 0)
        deltas = tuple(now - before for now, before in zip(totals, self._reported))
        self._reported = totals
        return (deltas[:4] if store is not None else None,
                (*deltas[4:], host.nbytes) if host is not None else None)

    def close(self, timeout_s: float = 5.0) -> None:
        self._reads.put(None)
        if self.store is not None:
            self.store.close(timeout_s)


def build_prefix_tier(config: EngineConfig, model_path: Path, kv_cache: KVCache, blocks: BlockManager, *,
                      arch: ModelArch, dtype: torch.dtype, quantization: str,
                      kernel_features: frozenset[str] | None, device: torch.device) -> PrefixTiers | None:
    """The second tiers the config asks for: host memory (--prefix-cache-host-size), a folder
    (--prefix-cache-dir), both, or neither (None). ValueError for a folder that others could write (a
    planted block would be read as this model's KV)."""
    cache = config.cache
    host_bytes = parse_bytes(cache.prefix_cache_host_size, "prefix_cache_host_size", allow_zero=True)
    if cache.prefix_cache_dir is None and not host_bytes:
        return None
    if config.model.tensor_parallel_size > 1:   # each rank holds a slice of every block
        raise ValueError("prefix_cache_dir and prefix_cache_host_size do not work with tensor_parallel_size > 1 yet")
    block_nbytes = kv_cache.tensor[:, :, 0].numel() * kv_cache.tensor.element_size()
    host = HostKVTier(block_nbytes, host_bytes, device) if host_bytes else None
    if host is not None:
        logger.info("prefix cache in host memory: up to %.1f GiB (%d blocks)", host_bytes / 2**30, host.max_blocks)
    if cache.prefix_cache_dir is None:
        return PrefixTiers(None, blocks, kv_cache, host=host)
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
    store = KVDiskStore.open(root, fingerprint, block_nbytes, cache.prefix_cache_disk_bytes)
    if store is None:
        raise ValueError(f"prefix_cache_dir {root} must be a folder that only this user can write")
    logger.info("prefix cache on disk: %s (%s, up to %.1f GiB)", store.folder, fingerprint.hex()[:12],
                cache.prefix_cache_disk_bytes / 2**30)
    return PrefixTiers(store, blocks, kv_cache, host=host)
