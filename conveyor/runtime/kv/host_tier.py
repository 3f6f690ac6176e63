"""HostKVTier: full KV blocks copied out of the KV cache into host memory, an LRU bounded in bytes.

    after a step:   each block hashed for the first time --copy--> a host buffer (pinned on CUDA, copied
                    non_blocking on the compute stream, one event per step), keyed by its chained hash
    before a step:  a prompt's blocks past its memory hits that are here are copied into free blocks
                    (prefix_tier.py adopts them), stopping at the first block that is not
    disk writes:    the disk tier's writer writes a block from its buffer here, once the copy's event is done

A buffer is written once, by the copy that fills it, and never again: the disk writer may read one the
LRU has already let go of. On CUDA the copies queue behind the step's kernels on the same stream, so a
block that the next step reuses is copied before it is overwritten, and the step loop never waits for a
copy; the caching host allocator keeps a freed buffer from reuse until the copies that touch it are done.
On the CPU the same code copies at once with plain memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class HostKVTier:
    """Invariant: `len(buffers) * block_nbytes <= max_bytes`; every buffer holds `block_nbytes` bytes of
    exactly the block its hash names, or, on CUDA, will once the copy queued before it completes."""

    def __init__(self, block_nbytes: int, max_bytes: int, device: torch.device) -> None:
        if max_bytes < block_nbytes:
            raise ValueError(f"prefix_cache_host_size of {max_bytes} bytes holds no block of {block_nbytes} bytes")
        self.block_nbytes, self.max_blocks = block_nbytes, max_bytes // block_nbytes
        self.is_cuda = device.type == "cuda"
        self.buffers: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # uint8 (block_nbytes,), least recent first
        self.bytes_written = 0    # device -> host, totals since start, for the metrics
        self.bytes_read = 0       # host -> device

    @property
    def nbytes(self) -> int:
        """Host memory the blocks here take."""
        return len(self.buffers) * self.block_nbytes

    def num_leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the chain's leading blocks are here (their recency untouched)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.buffers:
                break
            count += 1
        return count

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark the blocks here among `block_hashes` most recently used (a prompt hit them in the KV cache):
        a prefix in steady use stays here for when the KV cache lets it go."""
        for block_hash in block_hashes:
            if block_hash in self.buffers:
                self.buffers.move_to_end(block_hash)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's buffer, now the most recently used; None if it is not here."""
        buffer = self.buffers.get(block_hash)
        if buffer is not None:
            self.buffers.move_to_end(block_hash)
        return buffer

    def put(self, block_hash: bytes, buffer: torch.Tensor) -> None:
        """Keep a block whose bytes are already in host memory (read from disk), evicting the least recent."""
        if block_hash in self.buffers:
            self.buffers.move_to_end(block_hash)
            return
        self.buffers[block_hash] = buffer
        while len(self.buffers) > self.max_blocks:
            self.buffers.popitem(last=False)

    def copy_out(self, kv: torch.Tensor, blocks: Sequence[tuple[bytes, int]]
                 ) -> tuple[list[tuple[bytes, torch.Tensor]], torch.cuda.Event | None]:
        """Copy each (hash, block id) of the KV cache tensor `kv` that is not here yet into a new buffer;
        returns the (hash, buffer) pairs copied and, on CUDA, the event that says their bytes are there."""
        copied: list[tuple[bytes, torch.Tensor]] = []
        for block_hash, block_id in blocks:
            if block_hash in self.buffers:
                self.buffers.move_to_end(block_hash)
                continue
            source = kv[:, :, block_id]   # (L, 2, block_size, H, D); int8: (L, 2, block bytes)
            buffer = torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)
            buffer.view(source.dtype).view(source.shape).copy_(source, non_blocking=self.is_cuda)
            self.put(block_hash, buffer)
            copied.append((block_hash, buffer))
        event = None
        if copied and self.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(kv.device))   # behind the copies just queued
        self.bytes_written += len(copied) * self.block_nbytes
        return copied, event

    def copy_in(self, buffer: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy a block's buffer into the KV cache block `dest`; on CUDA it lands before the next step's kernels."""
        dest.copy_(buffer.view(dest.dtype).view(dest.shape), non_blocking=self.is_cuda)
        self.bytes_read += self.block_nbytes
