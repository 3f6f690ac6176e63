"""DiskPrefixTier: the prefix cache's second tier, between the block manager and a KVDiskStore.

    after a step:      blocks hashed for the first time --copy (memcpy)--> writer thread --> ROOT/.../<hash>.kv
    before a schedule: waiting prompt's blocks past its memory hits <--read-- files, into free blocks,
                       adopted under their hashes; the scheduler then finds them as cached blocks

Every full block goes to the disk once, as soon as it is cached (not when memory evicts it): its copy
then outlives an eviction, a restart and a crash alike, and shutdown has nothing to flush. The copy
out is a memcpy on the step loop; the disk write is not. The read back is on the step loop, one block
file per 16 tokens (tens of milliseconds for thousands of tokens against seconds to recompute them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import Request
from conveyor.runtime.kv_cache import KVCache
from conveyor.runtime.kv_disk import KVDiskStore
from conveyor.runtime.kv_fingerprint import kv_fingerprint, model_digest

logger = logging.getLogger(__name__)

_LOOKAHEAD = 8   # waiting requests whose prefix is read back before they are admitted


class DiskPrefixTier:
    def __init__(self, store: KVDiskStore, blocks: BlockManager, kv_cache: KVCache) -> None:
        self.store, self.blocks, self.kv_cache = store, blocks, kv_cache
        blocks.track_new_blocks = True
        self.num_query_tokens = 0    # prompt tokens past the memory hits looked up on disk
        self.num_loaded_tokens = 0   # of which read back (used or not)
        self._looked_up: set[str] = set()   # waiting requests already looked up
        self._reported = (0, 0, 0, 0)       # take_counts' totals at its last call

    # ------------------------------------------------------------ reading back

    def load_for(self, waiting: Sequence[Request]) -> None:
        """Read back the disk blocks of the first waiting requests' prompts, once per wait."""
        heads = waiting[:_LOOKAHEAD]
        for request in heads:
            if request.request_id not in self._looked_up:
                self._looked_up.add(request.request_id)
                self.load(request)
        self._looked_up.intersection_update(r.request_id for r in heads)

    def load(self, request: Request) -> int:
        """Bring the request's leading full blocks that are on disk but not in memory into free blocks;
        returns how many were read. Stops at the first miss: a chain is only as long as its first gap."""
        blocks, size = self.blocks, self.blocks.block_size
        in_memory = blocks.find_cached_blocks(request)
        wanted = request.block_hashes[len(in_memory):(request.num_tokens - 1) // size]
        if not wanted:
            return 0
        blocks.touch(in_memory)   # so that no block adopted below evicts them
        room = blocks.num_free_blocks - sum(1 for b in in_memory if blocks.ref_counts[b] == 0)
        self.num_query_tokens += len(wanted) * size
        num_read = 0
        for block_hash in wanted[:room]:
            cached = blocks.cached.get(block_hash)
            if cached is not None:   # a later block of the chain is still in memory
                blocks.touch([cached])
                continue
            payload = self.store.read(block_hash)
            if payload is None:
                break
            block_id = blocks.adopt(block_hash)
            if block_id is None:
                break
            self._write_block(block_id, payload)
            num_read += 1
        self.num_loaded_tokens += num_read * size
        return num_read

    def _write_block(self, block_id: int, payload) -> None:  # noqa: ANN001 - a uint8 numpy array
        dest = self.kv_cache.tensor[:, :, block_id]    # (L, 2, block_size, H, D)
        source = torch.tensor(payload).view(dest.dtype).view(dest.shape)
        dest.copy_(source)

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
        self.store.close(timeout_s)


def build_disk_tier(config: EngineConfig, model_path: Path, kv_cache: KVCache, blocks: BlockManager, *,
                    arch, dtype: torch.dtype, quantization: str,  # noqa: ANN001 - a ModelArch
                    kernel_features: frozenset[str] | None, device: torch.device) -> DiskPrefixTier | None:
    """The disk tier the config asks for (None without --prefix-cache-dir or in a folder we cannot trust)."""
    cache = config.cache
    if cache.prefix_cache_dir is None:
        return None
    if config.model.tensor_parallel_size > 1:   # each rank holds a slice of every block
        raise ValueError("prefix_cache_dir does not work with tensor_parallel_size > 1 yet")
    root = Path(cache.prefix_cache_dir)
    digest = model_digest(model_path, root)
    fingerprint = kv_fingerprint(digest, arch, dtype=dtype, kv_dtype=kv_cache.tensor.dtype, quantization=quantization,
                                 kernel_features=kernel_features, device=device, block_size=kv_cache.block_size,
                                 transposed_keys=kv_cache.transposed_keys,
                                 tensor_parallel_size=config.model.tensor_parallel_size)
    block_nbytes = kv_cache.tensor[:, :, 0].numel() * kv_cache.tensor.element_size()
    store = KVDiskStore.open(root, fingerprint, block_nbytes, cache.prefix_cache_disk_bytes)
    if store is None:
        return None
    logger.info("prefix cache on disk: %s (%s, up to %.1f GiB)", store.folder, fingerprint.hex()[:12],
                cache.prefix_cache_disk_bytes / 2**30)
    return DiskPrefixTier(store, blocks, kv_cache)
