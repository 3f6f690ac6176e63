"""Paged attention read in place: torch's FlexAttention over the whole KV cache, steered by a block mask.

A layer's K and V, (num_blocks, block_size, KV, D) each, are viewed as one sequence of
num_blocks * block_size keys, (1, KV, S, D), without a copy. Each row of a group (decode rows, or
prompt chunks; queries padded to (B, Lq) as the SDPA path pads them) gets a block mask that lists,
per tile of `q_block` queries, the cache blocks those queries see: blocks wholly visible to every
query of the tile as *full* (no mask evaluated), the blocks on the causal diagonal and at the
sliding window's start as *partial*, where `mask_mod` decides key by key. A step thus reads the
blocks its rows attend and nothing else: its cost follows the tokens attended, not the longest
context in the step.

`mask_mod` sees physical key indices. `block_position[block]` gives a block's index in the tables of
the group's rows that hold it (a block shared by several rows holds the same positions in each:
prefix blocks are found by the hash of every token before them), and the row's own table confirms
that it holds the block; from there the key's position, causality and the window follow.

On CUDA flex_attention runs compiled, once per shape class (decode rows or prompt chunks, with or
without a window) with dynamic sizes; sizes of 1 are padded to 2 so that they do not specialise a
compile of their own. Elsewhere the same block masks run as flex_attention's eager reference does:
every key of the cache scored, `mask_mod` evaluated densely, one SDPA call (without the dynamo trace
that eager flex_attention costs per call, ~0.2 s). So `mask_mod` alone must be exact, and the block
lists must cover it (tests/model/test_flex_attention.py checks both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

DECODE_Q_BLOCK = 16   # a decode row has one query: the smallest tile the kernel takes
PREFILL_Q_BLOCK = 64  # prompt chunks: queries per tile, each tile with its own list of blocks


@dataclass(slots=True)
class FlexGroup:
    """Rows attended together by one flex_attention call."""

    query_index: torch.Tensor     # (B, Lq) long: packed token index of each padded query slot
    out_rows: torch.Tensor        # (n,) long: flat positions in B * Lq that hold real queries
    out_tokens: torch.Tensor      # (n,) long: packed token index of each of those queries
    masks: dict[int | None, BlockMask]   # by sliding window (None: causal only)
    q_block: int


@dataclass(slots=True)
class FlexPlan:
    groups: list[FlexGroup]


def block_positions(tables: torch.Tensor, num_blocks: torch.Tensor, num_cache_blocks: int) -> torch.Tensor:
    """(num_cache_blocks + 1,) long: each cache block's index in the tables that hold it, else -1.
    tables (B, NB) padded past each row's num_blocks (B,); the padding lands in the last, unused slot."""
    width = tables.shape[1]
    index = torch.arange(width, device=tables.device).expand_as(tables)
    target = torch.where(index < num_blocks[:, None], tables, num_cache_blocks)
    out = torch.full((num_cache_blocks + 1,), -1, dtype=torch.long, device=tables.device)
    return out.scatter_(0, target.reshape(-1), index.reshape(-1))   # a shared block: the same index in each row


def paged_mask_mod(tables: torch.Tensor, block_position: torch.Tensor, query_pos: torch.Tensor, block_size: int,
                   window: int | None) -> Callable:
    """mask_mod over physical keys: True where row b's query q_idx (at query_pos[b, q_idx]; -1 for
    padding) may see the key at cache slot kv_idx."""
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        block = kv_idx // block_size
        logical = block_position[block]
        held = (logical >= 0) & (tables[b, logical.clamp(min=0)] == block)
        key_pos = logical * block_size + kv_idx % block_size
        query = query_pos[b, q_idx]
        visible = held & (key_pos <= query)
        if window is not None:
            visible = visible & (key_pos > query - window)
        return visible
    return mask_mod


def _block_lists(first_pos: torch.Tensor, num_query: torch.Tensor, tables: torch.Tensor, block_size: int,
                 window: int | None, q_block: int, num_q_blocks: int) -> tuple[torch.Tensor, ...]:
    """(partial counts, partial blocks, full counts, full blocks) per (row, query tile): (B, 1, QB) and
    (B, 1, QB, NB) int32. Only tensor arithmetic, no host sync: it runs inside a CUDA graph too.

    A tile's queries sit at positions p_lo..p_hi and see logical blocks lo..hi. Block j is full when
    every one of them sees all of it: (j + 1) * bs - 1 <= p_lo and, with a window W, j * bs > p_hi - W.
    The full blocks are one run f_lo..f_hi - 1, so the partial ones are lo..f_lo - 1 and f_hi..hi."""
    num_rows, width = tables.shape
    start = torch.arange(num_q_blocks, device=tables.device) * q_block           # (QB,)
    real = start[None, :] < num_query[:, None]                                   # (B, QB)
    p_lo = first_pos[:, None] + start[None, :]
    p_hi = first_pos[:, None] + torch.minimum(start[None, :] + q_block, num_query[:, None]) - 1
    hi = p_hi // block_size
    if window is None:
        lo = f_lo = torch.zeros_like(p_lo)
    else:
        lo = (p_lo - window + 1).clamp(min=0) // block_size
        f_lo = ((p_hi - window + 1).clamp(min=0) + block_size - 1) // block_size
    f_hi = (p_lo + 1) // block_size
    has_full = f_hi > f_lo
    f_lo = torch.where(has_full, f_lo, hi + 1)
    f_hi = torch.where(has_full, f_hi, hi + 1)
    num_head = f_lo - lo
    num_partial = torch.where(real, num_head + hi + 1 - f_hi, 0)
    num_full = torch.where(real, f_hi - f_lo, 0)
    i = torch.arange(width, device=tables.device)
    partial = torch.where(i < num_head[..., None], lo[..., None] + i, f_hi[..., None] + i - num_head[..., None])
    full = f_lo[..., None] + i

    def physical(logical: torch.Tensor) -> torch.Tensor:   # (B, QB, NB) logical -> physical block ids
        picked = tables.gather(1, logical.clamp(0, width - 1).reshape(num_rows, -1))
        return picked.view(num_rows, 1, num_q_blocks, width).to(torch.int32)

    as_counts = lambda n: n.view(num_rows, 1, num_q_blocks).to(torch.int32)  # noqa: E731
    return as_counts(num_partial), physical(partial), as_counts(num_full), physical(full)


def flex_group(query_index: torch.Tensor, first_pos: torch.Tensor, num_query: torch.Tensor, tables: torch.Tensor,
               out_rows: torch.Tensor, out_tokens: torch.Tensor, block_size: int, num_cache_blocks: int,
               windows: tuple[int | None, ...], q_block: int) -> FlexGroup:
    """A group's block masks (one per window) from its rows: query_index (B, Lq), first_pos (B,) the
    position of each row's first query, num_query (B,), tables (B, NB) long; all on the device."""
    num_query_slots = query_index.shape[1]
    offsets = torch.arange(num_query_slots, device=tables.device)
    query_pos = torch.where(offsets[None, :] < num_query[:, None], first_pos[:, None] + offsets[None, :], -1)
    num_blocks = (first_pos + num_query + block_size - 1) // block_size
    position = block_positions(tables, num_blocks, num_cache_blocks)
    num_q_blocks = -(-num_query_slots // q_block)
    masks = {}
    for window in windows:
        lists = _block_lists(first_pos, num_query, tables, block_size, window, q_block, num_q_blocks)
        masks[window] = BlockMask.from_kv_blocks(
            *lists, BLOCK_SIZE=(q_block, block_size),
            mask_mod=paged_mask_mod(tables, position, query_pos, block_size, window),
            seq_lengths=(num_query_slots, num_cache_blocks * block_size), compute_q_blocks=False)
    return FlexGroup(query_index, out_rows, out_tokens, masks, q_block)


@functools.cache
def _compiled_flex() -> Callable:
    # Each shape class (decode or chunk, window or not, per model shape and dtype) compiles once; past
    # dynamo's default of 8 it would fall back to eager flex_attention, which scores the whole cache.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


def dense_mask(block_mask: BlockMask, num_rows: int, num_query_slots: int, num_keys: int,
               device: torch.device) -> torch.Tensor:
    """(B, 1, Lq, S) bool: block_mask's mask_mod at every (query, key), as flex_attention's eager
    reference evaluates it (mask_mod's indexing broadcasts, so no vmap is needed)."""
    b = torch.arange(num_rows, device=device)[:, None, None, None]
    q_idx = torch.arange(num_query_slots, device=device)[None, None, :, None]
    kv_idx = torch.arange(num_keys, device=device)[None, None, None, :]
    return block_mask.mask_mod(b, torch.zeros_like(b), q_idx, kv_idx)


def dense_flex(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: BlockMask,
               scale: float) -> torch.Tensor:
    """flex_attention's eager semantics in one SDPA call: q (B, H, Lq, D) against every key of
    keys/values (1, KV, S, D), masked by mask_mod; a query that sees nothing gets zeros."""
    rows, num_heads, num_query_slots, _ = q.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    mask = dense_mask(block_mask, rows, num_query_slots, num_keys, q.device)
    shape = (rows, num_kv_heads, num_keys, keys.shape[3])
    out = F.scaled_dot_product_attention(q, keys.expand(shape), values.expand(shape), attn_mask=mask, scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    return torch.where(mask.any(dim=-1, keepdim=True), out, 0.0)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlexPlan, scale: float,
           window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Every query, (T, H, D), against its row's blocks, read in place from the caches
    (num_blocks, block_size, KV, D); results written to `out` (T, H, D)."""
    num_blocks, block_size, num_kv_heads, head_dim = v_cache.shape
    num_heads = q.shape[1]
    keys = k_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)    # (1, KV, S, D)
    values = v_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    if k_cache.dtype == torch.int8:
        raise ValueError("FlexAttention reads a float KV cache: an int8 cache runs on the C attention kernel")
    on_gpu = q.device.type == "cuda"
    if not on_gpu:   # the dense reference reads the cache in the queries' dtype, as the SDPA path gathers it
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    for group in plan.groups:
        rows, num_query_slots = group.query_index.shape
        # The kernel reads the cache in place: a 16-bit cache beside float32 queries meets them in 16 bits.
        qg = q[group.query_index].transpose(1, 2).to(keys.dtype)                           # (B, H, Lq, D)
        block_mask = group.masks[window]
        if on_gpu:
            options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": group.q_block, "BLOCK_N": min(block_size, 64)}
            og = _compiled_flex()(qg, keys, values, block_mask=block_mask, scale=scale,
                                  enable_gqa=num_heads != num_kv_heads, kernel_options=options)  # (B, H, Lq, D)
        else:
            og = dense_flex(qg, keys, values, block_mask, scale)
        og = og.transpose(1, 2).reshape(rows * num_query_slots, num_heads, head_dim)
        out[group.out_tokens] = og[group.out_rows].to(out.dtype)
    return out
