"""BlockManager without a scheduler: counts, ref counts, free-list order, prefix-cache hashing and reuse."""

from __future__ import annotations

import pytest
from helpers import audit_blocks, make_request

from conveyor.core.block_manager import BlockManager, hash_block
from conveyor.core.request import Request

BS = 4


def computed(request: Request, blocks: BlockManager, num_tokens: int | None = None) -> Request:
    """Allocate for and mark as computed the request's first `num_tokens` (default: all) tokens."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    blocks.allocate(request, num_tokens)
    request.num_computed_tokens = num_tokens
    blocks.cache_full_blocks(request)
    return request


def admit(request: Request, blocks: BlockManager) -> list[int]:
    """What the scheduler does on admission: attach the cached prefix, allocate the rest."""
    cached = blocks.find_cached_blocks(request)
    blocks.allocate(request, request.num_tokens, cached)
    request.num_computed_tokens = len(cached) * blocks.block_size
    return cached


def free_queue(blocks: BlockManager) -> list[int]:
    return list(blocks.free_queue)


# ------------------------------------------------------------ allocation and counts

def test_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_and_free_counts() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", prompt_len=10)
    assert blocks.blocks_for(10) == 3 and blocks.blocks_for(12) == 3 and blocks.blocks_for(13) == 4
    blocks.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert blocks.num_free_blocks == 5 and blocks.num_used_blocks == 3 and blocks.usage == 3 / 8
    assert blocks.ref_counts[:4] == [1, 1, 1, 0]
    audit_blocks(blocks, [a])

    blocks.allocate(a, 12)                      # still fits in 3 blocks
    assert a.block_table == [0, 1, 2]
    blocks.allocate(a, 13)                      # grows by one
    assert a.block_table == [0, 1, 2, 3] and blocks.num_free_blocks == 4
    audit_blocks(blocks, [a])

    blocks.free(a)
    assert a.block_table == [] and blocks.num_free_blocks == 8 and blocks.num_used_blocks == 0
    assert blocks.ref_counts == [0] * 8
    audit_blocks(blocks, [])


def test_can_allocate_false_when_full() -> None:
    blocks = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_request("a", prompt_len=12), make_request("b", prompt_len=8)
    assert blocks.can_allocate(a, 16)
    assert not blocks.can_allocate(a, 17)
    blocks.allocate(a, 12)
    assert blocks.num_free_blocks == 1
    assert blocks.can_allocate(b, 4)
    assert not blocks.can_allocate(b, 5)
    assert blocks.num_new_blocks(b, 8) == 2
    with pytest.raises(RuntimeError):
        blocks.allocate(b, 8)
    assert b.block_table == [] and blocks.num_free_blocks == 1   # a failed allocate takes nothing
    audit_blocks(blocks, [a, b])
    blocks.allocate(b, 4)
    assert blocks.num_free_blocks == 0 and not blocks.can_allocate(b, 5)
    assert blocks.can_allocate(a, 12)           # needs nothing new
    audit_blocks(blocks, [a, b])


def test_freed_unhashed_blocks_are_reused_first() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", prompt_len=12), make_request("b", prompt_len=4)
    blocks.allocate(a, 12)
    blocks.allocate(b, 4)
    assert a.block_table == [0, 1, 2] and b.block_table == [3]
    blocks.free(a)
    audit_blocks(blocks, [b])
    assert set(free_queue(blocks)[:3]) == {0, 1, 2}     # ahead of the never-used 4..7
    c = make_request("c", prompt_len=12)
    blocks.allocate(c, 12)
    assert set(c.block_table) == {0, 1, 2}
    audit_blocks(blocks, [b, c])


# ------------------------------------------------------------ prefix caching

def test_prefix_caching_off_never_hits() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = computed(make_request("a", prompt_len=12), blocks)
    assert blocks.cached == {} and blocks.block_hashes == [None] * 8
    b = make_request("b", prompt_len=13)
    assert blocks.find_cached_blocks(b) == []
    blocks.free(a)
    assert blocks.find_cached_blocks(b) == []
    audit_blocks(blocks, [])


def test_cache_full_blocks_publishes_only_full_computed_blocks() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", prompt_len=10)
    blocks.allocate(a, 10)
    blocks.cache_full_blocks(a)                 # nothing computed yet
    assert blocks.cached == {}
    a.num_computed_tokens = 3
    blocks.cache_full_blocks(a)                 # block 0 not yet full of computed tokens
    assert blocks.cached == {}
    a.num_computed_tokens = 6
    blocks.cache_full_blocks(a)
    assert [blocks.block_hashes[b] is not None for b in a.block_table] == [True, False, False]
    a.num_computed_tokens = 10
    blocks.cache_full_blocks(a)                 # block 2 holds 2 of 4 tokens: never published
    assert [blocks.block_hashes[b] is not None for b in a.block_table] == [True, True, False]
    assert blocks.cached == {a.block_hashes[0]: a.block_table[0], a.block_hashes[1]: a.block_table[1]}
    audit_blocks(blocks, [a])


@pytest.mark.parametrize("num_tokens,num_hit_blocks", [
    (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3), (16, 3), (17, 4), (20, 4),
])
def test_find_cached_blocks_leaves_the_last_token_to_compute(num_tokens: int, num_hit_blocks: int) -> None:
    blocks = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=16), blocks)     # 4 full blocks published
    assert len(blocks.cached) == 4
    b = make_request("b", prompt=a.prompt_token_ids[:num_tokens] + [999] * max(0, num_tokens - 16))
    hit = blocks.find_cached_blocks(b)
    assert hit == a.block_table[:num_hit_blocks]
    # k * block_size tokens hit k - 1 blocks; k * block_size + 1 tokens hit k.
    assert len(hit) == min((num_tokens - 1) // BS, 4)
    audit_blocks(blocks, [a])


def test_hashes_are_chained_to_the_whole_prefix() -> None:
    assert hash_block(None, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])
    blocks = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9]), blocks)
    assert len(blocks.cached) == 2
    same_second_block = make_request("b", prompt=[9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert blocks.find_cached_blocks(same_second_block) == []
    same_first_block = make_request("c", prompt=[1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert blocks.find_cached_blocks(same_first_block) == a.block_table[:1]
    same_both = make_request("d", prompt=[1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    assert blocks.find_cached_blocks(same_both) == a.block_table[:2]
    # The same second block under another prefix is another cache entry, not a duplicate of a's.
    computed(same_second_block, blocks)
    assert same_second_block.block_hashes[1] != a.block_hashes[1]
    assert len(blocks.cached) == 4
    assert blocks.cached[same_second_block.block_hashes[1]] == same_second_block.block_table[1]
    audit_blocks(blocks, [a, same_second_block])


def test_shared_block_is_freed_only_when_both_holders_free_it() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=9), blocks)
    b = make_request("b", prompt=a.prompt_token_ids[:8] + [7, 7])
    hit = admit(b, blocks)
    assert hit == a.block_table[:2] and b.block_table[:2] == hit and b.num_computed_tokens == 8
    assert [blocks.ref_counts[x] for x in hit] == [2, 2]
    assert blocks.num_used_blocks == 3 + 1
    audit_blocks(blocks, [a, b])

    blocks.free(a)
    assert [blocks.ref_counts[x] for x in hit] == [1, 1]
    assert not any(x in blocks.free_queue for x in hit)
    audit_blocks(blocks, [b])

    blocks.free(b)
    assert [blocks.ref_counts[x] for x in hit] == [0, 0]
    assert all(x in blocks.free_queue for x in hit)
    assert all(blocks.block_hashes[x] is not None for x in hit)   # still findable
    audit_blocks(blocks, [])


def test_cached_blocks_survive_free_and_are_reused_until_evicted() -> None:
    blocks = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=9), blocks)          # blocks 0, 1 hashed; 2 partial
    published = a.block_table[:2]
    blocks.free(a)
    audit_blocks(blocks, [])

    b = make_request("b", prompt=a.prompt_token_ids[:8] + [1])
    assert blocks.num_new_blocks(b, 9, published) == 3               # 2 revived + 1 fresh
    assert admit(b, blocks) == published
    assert blocks.num_free_blocks == 3
    audit_blocks(blocks, [b])
    blocks.free(b)

    # Fill the whole pool with unrelated tokens: every cached block gets evicted.
    filler = make_request("filler", prompt=[7] * 24)
    blocks.allocate(filler, 24)
    assert blocks.cached == {} and all(h is None for h in blocks.block_hashes)
    audit_blocks(blocks, [filler])
    blocks.free(filler)
    c = make_request("c", prompt=a.prompt_token_ids[:8] + [1])
    assert blocks.find_cached_blocks(c) == []
    audit_blocks(blocks, [])


def test_free_queues_hashed_tail_blocks_first_and_unhashed_ahead_of_them() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=14), blocks)          # 3 full blocks + a partial one
    assert a.block_table == [0, 1, 2, 3]
    blocks.free(a)
    # The partial block (no reusable content) goes first; the hashed ones last, tail before head.
    assert free_queue(blocks) == [3, 4, 5, 6, 7, 2, 1, 0]
    audit_blocks(blocks, [])

    # Taking 6 blocks evicts only the tail block 2, so a's first two blocks still hit.
    filler = make_request("filler", prompt=[7] * 21)
    blocks.allocate(filler, 21)
    assert filler.block_table == [3, 4, 5, 6, 7, 2]
    b = make_request("b", prompt=a.prompt_token_ids + [1])
    assert blocks.find_cached_blocks(b) == [0, 1]
    audit_blocks(blocks, [filler])


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    blocks = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    p = computed(make_request("p", prompt=[1, 1, 1, 1]), blocks)
    q = computed(make_request("q", prompt=[2, 2, 2, 2]), blocks)
    blocks.free(p)                              # p's block freed first ...
    blocks.free(q)
    p_block, q_block = blocks.cached[p.block_hashes[0]], blocks.cached[q.block_hashes[0]]
    assert free_queue(blocks)[-2:] == [p_block, q_block]

    # ... but reusing it makes it the most recently used.
    p2 = make_request("p2", prompt=[1, 1, 1, 1, 9])
    assert admit(p2, blocks) == [p_block]
    blocks.free(p2)
    assert free_queue(blocks)[-2:] == [q_block, p_block]
    audit_blocks(blocks, [])

    # Three fresh blocks: the two never-hashed ones, then the least recently freed cached one (q).
    filler = make_request("filler", prompt=[7] * 12)
    blocks.allocate(filler, 12)
    assert q_block in filler.block_table and p_block not in filler.block_table
    assert blocks.find_cached_blocks(make_request("q2", prompt=[2, 2, 2, 2, 9])) == []
    assert blocks.find_cached_blocks(make_request("p3", prompt=[1, 1, 1, 1, 9])) == [p_block]
    audit_blocks(blocks, [filler])


def test_duplicate_computation_keeps_the_first_copy_shared() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", prompt_len=9)
    b = make_request("b", prompt_len=9)         # same tokens, admitted before a published anything
    assert admit(a, blocks) == [] and admit(b, blocks) == []
    a.num_computed_tokens = b.num_computed_tokens = 9
    blocks.cache_full_blocks(a)
    blocks.cache_full_blocks(b)
    assert set(blocks.cached.values()) == set(a.block_table[:2])
    assert all(blocks.block_hashes[x] is None for x in b.block_table)
    audit_blocks(blocks, [a, b])
    b_blocks = list(b.block_table)
    blocks.free(b)                              # b's copies hold nothing findable: reused first
    assert set(free_queue(blocks)[:3]) == set(b_blocks)
    audit_blocks(blocks, [a])
    c = make_request("c", prompt_len=10)
    assert admit(c, blocks) == a.block_table[:2]
    audit_blocks(blocks, [a, c])


def test_num_new_blocks_counts_revived_cached_blocks() -> None:
    blocks = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=9), blocks)
    hit_ids = a.block_table[:2]
    b = make_request("b", prompt_len=9)
    assert blocks.num_new_blocks(b, 9, hit_ids) == 1          # held by a: attaching costs nothing
    blocks.free(a)
    assert blocks.num_new_blocks(b, 9, hit_ids) == 3          # now they leave the free queue too
    assert blocks.can_allocate(b, 9, hit_ids)
    assert blocks.num_new_blocks(b, 17, hit_ids) == 5 and not blocks.can_allocate(b, 17, hit_ids)
    audit_blocks(blocks, [])


def test_reset_prefix_cache_drops_only_unreferenced_blocks() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt=[1] * 4 + [0]), blocks)
    b = computed(make_request("b", prompt=[2] * 4 + [0]), blocks)
    blocks.free(a)
    blocks.reset_prefix_cache()
    assert list(blocks.cached.values()) == [b.block_table[0]]
    assert blocks.find_cached_blocks(make_request("a2", prompt=[1] * 4 + [0])) == []
    audit_blocks(blocks, [b])


# ------------------------------------------------------------ a second tier's doors

def test_new_blocks_are_listed_once_for_a_second_tier() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    blocks.track_new_blocks = True
    a = computed(make_request("a", prompt_len=9), blocks)
    assert blocks.take_new_blocks() == [(a.block_hashes[0], a.block_table[0]), (a.block_hashes[1], a.block_table[1])]
    computed(make_request("b", prompt_len=9), blocks)   # the same prompt: shared, nothing new
    assert blocks.take_new_blocks() == []


def test_adopted_blocks_are_found_and_counted_as_disk_hits() -> None:
    blocks = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=9), blocks)   # caches 2 blocks of 3
    blocks.free(a)
    b = make_request("b", prompt=[*a.prompt_token_ids[:8], 7, 8, 9, 10, 11])
    blocks.update_hashes(b)
    held = blocks.find_cached_blocks(b)
    blocks.touch(held)
    adopted = blocks.adopt(b.block_hashes[2])    # as if read back from disk
    assert adopted is not None and adopted not in held
    assert blocks.adopt(b.block_hashes[2]) is None   # already cached
    assert list(blocks.free_queue)[-3:] == [*held, adopted]   # evicted last
    cached = admit(b, blocks)
    assert cached == [*held, adopted] and blocks.num_adopted_hit_tokens == 0
    blocks.record_lookup(b.num_tokens, len(cached) * BS, cached)   # a first admission's hits
    assert blocks.num_hit_tokens == 3 * BS and blocks.num_adopted_hit_tokens == BS
    blocks.record_lookup(b.num_tokens, len(cached) * BS, cached)   # counted once
    assert blocks.num_adopted_hit_tokens == BS
    audit_blocks(blocks, [b])


def test_adopt_takes_the_least_recently_freed_block() -> None:
    blocks = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = computed(make_request("a", prompt_len=8), blocks)    # 2 cached blocks
    table, hashes = list(a.block_table), list(a.block_hashes)
    c = make_request("c", prompt_len=4)
    blocks.allocate(c, 4)
    assert blocks.adopt(b"h" * 32) is None          # nothing free
    blocks.free(a)                                   # the tail block first in the queue
    block_id = blocks.adopt(b"h" * 32)
    assert block_id == table[1] and blocks.cached[b"h" * 32] == block_id
    assert hashes[1] not in blocks.cached and blocks.cached[hashes[0]] == table[0]
    assert list(blocks.free_queue) == [table[0], block_id]
    audit_blocks(blocks, [c])
    assert BlockManager(2, BS).adopt(b"h" * 32) is None   # no prefix cache, no second tier
