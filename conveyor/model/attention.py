"""Packed variable-length attention over a paged KV cache.

A step's tokens arrive packed, (T, H, D), from many rows (requests); each row has its own
context held in fixed-size KV blocks listed by its block table. Rows are attended in a few
*groups* (decode rows with one query each, prefill chunks with many), each group as one batched
op: its queries padded to (B, Lq), its keys gathered block-wise to (B, NB * block_size), and a
boolean mask that encodes both the padding and causality. A step thus costs one batched
attention call per group and layer, never a Python loop per row or token.

On CPU the C kernel (kernels/attention.c) replaces the groups: every query of the step, decode or
prompt, goes through one code path straight from the cache blocks, so a token's result does not
depend on how its prompt was chunked or batched, even in bfloat16.

The FlexAttention backend (flex_paged.py) keeps the groups but reads the cache blocks in place,
steered by a block mask, instead of gathering them: a step costs what its rows attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from conveyor import kernels
from conveyor.model import kv_quant
from conveyor.model.attention_backends import flex_paged


@dataclass(slots=True)
class AttentionGroup:
    """Rows padded together for torch's attention."""

    query_index: torch.Tensor     # (B, Lq) long: packed token index of each padded query slot
    block_tables: torch.Tensor    # (B, NB) long: padded with block 0, which the mask hides
    mask: torch.Tensor            # (B, 1, Lq, NB * block_size) bool: True = may attend
    window_mask: torch.Tensor | None  # the same with the sliding window applied, if the model has one
    out_rows: torch.Tensor        # (n,) long: flat positions in B * Lq that hold real queries
    out_tokens: torch.Tensor      # (n,) long: packed token index of each of those queries


@dataclass(slots=True)
class KernelPlan:
    """Every query of the step for the C kernel: no padding, each query with its own context length."""

    block_tables: torch.Tensor    # (R, NB) long, one row per step row
    rows: torch.Tensor            # (T,) long: each query's row
    context_lens: torch.Tensor    # (T,) long: keys each query sees (its position + 1)
    tokens: torch.Tensor          # (T,) long: each query's packed token index
    tile_start: torch.Tensor      # (tiles + 1,) long: tiles of consecutive queries of one row
    max_context: int = 0          # the longest context: every query's position is below it


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor    # (T,) long: cache slot (block_id * block_size + offset) per token
    groups: list[AttentionGroup]  # the torch path
    kernel: KernelPlan | None = None  # the C kernel path (float32 or bfloat16 on CPU), instead of groups
    flex: flex_paged.FlexPlan | None = None   # FlexAttention over the blocks in place, instead of groups

    @property
    def use_kernel(self) -> bool:
        return self.kernel is not None


@dataclass(slots=True)
class RowSpec:
    """One row of a step: `num_query` new tokens ending a context of `context_len` tokens."""

    token_start: int              # index of the row's first token in the packed batch
    num_query: int
    context_len: int              # tokens in the cache after this step's writes
    block_table: list[int]


def _pad(rows: list[RowSpec], num_rows: int, max_query: int, max_blocks: int) -> tuple[torch.Tensor, ...]:
    """Rows padded to (num_rows, max_query) queries and (num_rows, max_blocks) blocks: padding rows have
    no queries and tables of block 0. Returns (first positions, query counts, tables, query_index, is_real)."""
    pad = num_rows - len(rows)
    starts = torch.tensor([r.token_start for r in rows] + [0] * pad, dtype=torch.long)
    num_query = torch.tensor([r.num_query for r in rows] + [0] * pad, dtype=torch.long)
    context_len = torch.tensor([r.context_len for r in rows] + [0] * pad, dtype=torch.long)
    tables = torch.tensor([r.block_table + [0] * (max_blocks - len(r.block_table)) for r in rows]
                          + [[0] * max_blocks] * pad, dtype=torch.long)
    offsets = torch.arange(max_query)                                 # (Lq,)
    is_real = offsets[None, :] < num_query[:, None]                   # (B, Lq)
    query_index = torch.where(is_real, starts[:, None] + offsets[None, :], 0)
    return context_len - num_query, num_query, tables, query_index, is_real


def build_group(rows: list[RowSpec], block_size: int, sliding_window: int | None,
                device: torch.device) -> AttentionGroup:
    """Pad a set of rows into one attention group (vectorised mask construction)."""
    max_query = max(r.num_query for r in rows)
    max_blocks = max(len(r.block_table) for r in rows)
    num_keys = max_blocks * block_size
    first_pos, _, tables, query_index, is_real = _pad(rows, len(rows), max_query, max_blocks)
    # Position of each query in its sequence; a key at position j is visible iff j <= that.
    query_pos = first_pos[:, None] + torch.arange(max_query)[None, :]  # (B, Lq)
    key_pos = torch.arange(num_keys)                                   # (Lk,)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]            # (B, Lq, Lk)
    window_mask = None
    if sliding_window is not None:
        window_mask = mask & (key_pos[None, None, :] > query_pos[:, :, None] - sliding_window)
        window_mask = window_mask[:, None].to(device)
    out_rows = is_real.reshape(-1).nonzero().squeeze(1)
    return AttentionGroup(
        query_index=query_index.to(device),
        block_tables=tables.to(device),
        mask=mask[:, None].to(device),
        window_mask=window_mask,
        out_rows=out_rows.to(device),
        out_tokens=query_index.reshape(-1)[out_rows].to(device),
    )


def build_flex_group(rows: list[RowSpec], block_size: int, sliding_window: int | None, device: torch.device,
                     num_cache_blocks: int, q_block: int) -> flex_paged.FlexGroup:
    """Rows padded as for build_group, without masks: their block masks are built on the device.
    Sizes of 1 (rows, blocks) and prompt chunks are padded up so compiled shapes stay few."""
    max_query = max(r.num_query for r in rows)
    if max_query > 1:
        max_query = max(2 * q_block, -(-max_query // q_block) * q_block)
    max_blocks = max(2, max(len(r.block_table) for r in rows))
    first_pos, num_query, tables, query_index, is_real = _pad(rows, max(2, len(rows)), max_query, max_blocks)
    out_rows = is_real.reshape(-1).nonzero().squeeze(1)
    windows = (None,) if sliding_window is None else (None, sliding_window)
    return flex_paged.flex_group(query_index.to(device), first_pos.to(device), num_query.to(device),
                                 tables.to(device), out_rows.to(device), query_index.reshape(-1)[out_rows].to(device),
                                 block_size, num_cache_blocks, windows, q_block)


def build_kernel_plan(rows: list[RowSpec], tile_size: int) -> KernelPlan:
    max_blocks = max(len(r.block_table) for r in rows)
    tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in rows]
    row_of: list[int] = []
    context_lens: list[int] = []
    tokens: list[int] = []
    tile_start: list[int] = []
    for i, r in enumerate(rows):
        first = r.context_len - r.num_query
        tile_start.extend(range(len(tokens), len(tokens) + r.num_query, tile_size))
        row_of.extend([i] * r.num_query)
        context_lens.extend(range(first + 1, r.context_len + 1))
        tokens.extend(range(r.token_start, r.token_start + r.num_query))
    tile_start.append(len(tokens))
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return KernelPlan(as_long(tables), as_long(row_of), as_long(context_lens), as_long(tokens), as_long(tile_start),
                      max(r.context_len for r in rows))


def build_metadata(rows: list[RowSpec], block_size: int, sliding_window: int | None,
                   device: torch.device, kernel_tile_size: int = 0, flex_cache_blocks: int = 0) -> AttentionMetadata:
    """Slot mapping for the rows' new tokens, and either the C kernel's plan (kernel_tile_size > 0,
    CPU) or the rows split into decode and prefill groups for torch: FlexAttention over a cache of
    `flex_cache_blocks` blocks (allocated, spare included) when that is > 0, else SDPA.

    Decode rows (one query each) and prefill chunks are padded separately, so a long chunk never
    pads hundreds of decode rows to its length.
    """
    slots: list[int] = []
    for r in rows:
        first = r.context_len - r.num_query
        slots.extend(r.block_table[p // block_size] * block_size + p % block_size
                     for p in range(first, r.context_len))
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    if kernel_tile_size > 0:
        return AttentionMetadata(slot_mapping, [], build_kernel_plan(rows, kernel_tile_size))
    decode = [r for r in rows if r.num_query == 1]
    prefill = [r for r in rows if r.num_query > 1]
    if flex_cache_blocks > 0:
        plan = flex_paged.FlexPlan([
            build_flex_group(g, block_size, sliding_window, device, flex_cache_blocks, q_block)
            for g, q_block in ((decode, flex_paged.DECODE_Q_BLOCK), (prefill, flex_paged.PREFILL_Q_BLOCK)) if g])
        return AttentionMetadata(slot_mapping, [], flex=plan)
    groups = [build_group(g, block_size, sliding_window, device) for g in (decode, prefill) if g]
    return AttentionMetadata(slot_mapping, groups)


def write_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> None:
    """Store this step's keys and values, (T, KV, D) each, at their slots of the caches. For the C
    kernel the keys are transposed, (num_blocks, KV, D, block_size): written through a permuted view.
    An int8 cache (code views) gets each token's codes and its scale per head (kv_quant.py)."""
    _, block_size, num_kv_heads, head_dim = v_cache.shape
    if k_cache.dtype == torch.int8:
        _write_int8(k, v, k_cache, v_cache, meta)
        return
    if meta.kernel is not None:
        blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        k_cache.permute(0, 3, 1, 2)[blocks, offsets] = k.to(k_cache.dtype)
    else:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))


def _write_int8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> None:
    block_size = v_cache.shape[1]
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    transposed = meta.kernel is not None
    for x, cache, is_key in ((k, k_cache, True), (v, v_cache, False)):
        codes, scales = kv_quant.quantize(x)                                   # (T, KV, D), (T, KV)
        if is_key and transposed:
            cache.permute(0, 3, 1, 2)[blocks, offsets] = codes
            kv_quant.scales_of(cache, True).permute(0, 2, 1)[blocks, offsets] = scales
        else:
            cache[blocks, offsets] = codes
            kv_quant.scales_of(cache, False)[blocks, offsets] = scales


def _gather(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, NB, bs, KV, D) of the rows' blocks as `dtype`: an int8 cache dequantized."""
    if cache.dtype != torch.int8:
        return cache[tables].to(dtype)
    return kv_quant.dequantize(cache[tables], kv_quant.scales_of(cache, False)[tables], dtype)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, window: int | None) -> torch.Tensor:
    """Attend every query, (T, H, D), to its row's cached context (this step's keys included).

    Returns (T, H, D) contiguous. q may be a strided view (e.g. into a fused qkv buffer).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if meta.kernel is not None:
        plan = meta.kernel
        return kernels.paged_attention(q, k_cache, v_cache, plan.block_tables, plan.rows, plan.context_lens,
                                       plan.tokens, plan.tile_start, scale, window, out)
    if meta.flex is not None:
        return flex_paged.attend(q, k_cache, v_cache, meta.flex, scale, window, out)
    for group in meta.groups:
        rows, max_query = group.query_index.shape
        num_keys = group.block_tables.shape[1] * block_size
        qg = q[group.query_index].transpose(1, 2)                                 # (B, H, Lq, D)
        kg = _gather(k_cache, group.block_tables, q.dtype).view(rows, num_keys, num_kv_heads, head_dim)
        vg = _gather(v_cache, group.block_tables, q.dtype).view(rows, num_keys, num_kv_heads, head_dim)
        mask = group.window_mask if window is not None and group.window_mask is not None else group.mask
        og = F.scaled_dot_product_attention(
            qg, kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )                                                                          # (B, H, Lq, D)
        og = og.transpose(1, 2).reshape(rows * max_query, num_heads, head_dim)
        out[group.out_tokens] = og[group.out_rows]
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query to its row's context.

    q: (T, H, D); k, v: (T, KV, D); k_cache, v_cache: (num_blocks, block_size, KV, D).
    Returns (T, H, D).
    """
    write_cache(k, v, k_cache, v_cache, meta)
    return attend(q, k_cache, v_cache, meta, scale, window)
