"""BlockManager: the KV blocks' free list, reference counts, block tables and prefix hashes.

Pure Python bookkeeping; the KV tensors themselves live in runtime/kv/cache.py.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from conveyor.core.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block chained to its parent's, so equal hashes mean equal whole prefixes."""
    h = hashlib.sha256(parent or b"")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    """Owns which block belongs to whom.

    Invariants (checked by `check_integrity`):
    - a block with ref_count 0 is in the free queue exactly once; a block in use is not in it;
    - a hashed block holds the KV of exactly the prefix its hash names and is never written again;
      it stays findable after it is freed, until it is evicted by reuse (least recently freed first).

    A second tier (host memory or a disk store the runtime owns) sees the cache through two doors: with
    `track_new_blocks`, each block hashed for the first time is listed for `take_new_blocks`, so its
    KV can be copied out before anything reuses it; and `adopt` takes a free block for KV read back
    from that tier, publishing it under its hash as a freed cached block would be.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_query_tokens = 0     # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0       # of which found
        self.track_new_blocks = False
        self.new_blocks: list[tuple[bytes, int]] = []   # (hash, block id) hashed since take_new_blocks
        # Read back from the second tier, not yet a first admission's hit: block id -> whether from host memory.
        self.adopted_ids: dict[int, bool] = {}
        self.num_adopted_hit_tokens = 0      # of num_hit_tokens, those adopted blocks gave
        self.num_host_hit_tokens = 0         # of num_adopted_hit_tokens, those adopted from host memory

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix cache

    def update_hashes(self, request: Request) -> None:
        """Extend the request's chain of full-block hashes to cover its current tokens."""
        hashes, size = request.block_hashes, self.block_size
        for i in range(len(hashes), request.num_tokens // size):
            hashes.append(hash_block(hashes[-1] if hashes else None, request.all_token_ids[i * size:(i + 1) * size]))

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Longest run of the request's leading full blocks already in the cache.

        The last token is always left to compute, so the step that admits it has logits to sample.
        """
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return []
        self.update_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        found: list[int] = []
        for block_hash in request.block_hashes[:limit]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int, cached_block_ids: Sequence[int] = ()) -> None:
        """Count a first admission's lookup; the adopted blocks among its hits count as the second tier's."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens
        for block_id in cached_block_ids:
            from_host = self.adopted_ids.pop(block_id, None)
            if from_host is not None:
                self.num_adopted_hit_tokens += self.block_size
                self.num_host_hit_tokens += self.block_size if from_host else 0

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        # The leading blocks published at earlier steps stay so while the request holds them: each
        # step looks only past them, not at its whole context again.
        published = min(request.num_published_blocks, num_full)
        for i in range(published, num_full):
            block_id = request.block_table[i]
            if self.block_hashes[block_id] is not None:
                if published == i:
                    published += 1
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self.cached:
                continue  # computed twice concurrently; the first copy stays the shared one (looked at again)
            self.block_hashes[block_id] = block_hash
            self.cached[block_hash] = block_id
            if published == i:
                published += 1
            if self.track_new_blocks:
                self.new_blocks.append((block_hash, block_id))
        request.num_published_blocks = published

    def take_new_blocks(self) -> list[tuple[bytes, int]]:
        """The (hash, block id) pairs hashed since the last call; their KV is intact until a later
        `allocate` reuses them."""
        taken, self.new_blocks = self.new_blocks, []
        return taken

    def touch(self, block_ids: Sequence[int]) -> None:
        """Move the free ones among `block_ids` to the back of the free queue: evicted last."""
        for block_id in block_ids:
            if block_id in self.free_queue:
                self.free_queue.move_to_end(block_id)

    def adopt(self, block_hash: bytes, from_host: bool = False) -> int | None:
        """A free block to hold the KV of `block_hash`, read back from the second tier: the least
        recently freed block is evicted for it, and it joins the cache as the most recently freed.
        The caller writes its KV before the next step. None when no block is free or the hash is cached."""
        if not self.enable_prefix_caching or not self.free_queue or block_hash in self.cached:
            return None
        block_id = next(iter(self.free_queue))
        self._evict(block_id)
        self.free_queue.move_to_end(block_id)
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id
        self.adopted_ids[block_id] = from_host
        return block_id

    # ------------------------------------------------------------ allocation

    def num_new_blocks(self, request: Request, num_tokens: int, cached_block_ids: Sequence[int] = ()) -> int:
        """Free blocks needed for the request to hold `num_tokens` tokens after attaching the cached ones."""
        needed = self.blocks_for(num_tokens) - len(request.block_table) - len(cached_block_ids)
        # Attaching a cached block that nobody holds takes it out of the free queue too.
        revived = sum(1 for b in cached_block_ids if self.ref_counts[b] == 0) if cached_block_ids else 0
        return max(needed, 0) + revived

    def capacity(self, request: Request) -> int:
        """Tokens the request could hold with every free block added to its own (evicting cached ones)."""
        return (len(request.block_table) + len(self.free_queue)) * self.block_size

    def can_allocate(self, request: Request, num_tokens: int, cached_block_ids: Sequence[int] = ()) -> bool:
        return self.num_new_blocks(request, num_tokens, cached_block_ids) <= len(self.free_queue)

    def allocate(self, request: Request, num_tokens: int, cached_block_ids: Sequence[int] = ()) -> None:
        """Attach the cached blocks, then grow the block table to cover `num_tokens` tokens."""
        if not self.can_allocate(request, num_tokens, cached_block_ids):
            raise RuntimeError(f"allocate without room for {request.request_id}")
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
            request.block_table.append(block_id)
        for _ in range(self.blocks_for(num_tokens) - len(request.block_table)):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            request.block_table.append(block_id)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the tail blocks beyond `num_tokens` tokens (slots of rejected draft tokens)."""
        keep = self.blocks_for(num_tokens)
        while len(request.block_table) > keep:
            block_id = request.block_table.pop()
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] == 0 and self.block_hashes[block_id] is None, \
                f"block {block_id} is shared or cached: not a draft's"
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks; tail blocks are queued first, so they go first."""
        for block_id in reversed(request.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # no content worth keeping
                else:
                    self.free_queue[block_id] = None
        request.block_table = []
        request.num_published_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached.values()):
            if self.ref_counts[block_id] == 0:
                self._evict(block_id)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None
        self.adopted_ids.pop(block_id, None)

    def check_integrity(self, requests: Sequence[Request] = ()) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging)."""
        holders = [0] * self.num_blocks
        for request in requests:
            for block_id in request.block_table:
                holders[block_id] += 1
        for block_id in range(self.num_blocks):
            is_free = block_id in self.free_queue
            assert (self.ref_counts[block_id] == 0) == is_free, f"block {block_id} free-list mismatch"
            if requests:
                assert holders[block_id] == self.ref_counts[block_id], f"block {block_id} ref count mismatch"
        assert len(self.free_queue) + sum(1 for r in self.ref_counts if r > 0) == self.num_blocks
        for block_hash, block_id in self.cached.items():
            assert self.block_hashes[block_id] == block_hash, f"block {block_id} hash mismatch"
