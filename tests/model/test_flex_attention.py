"""FlexAttention over the paged cache in place (model/flex_paged.py) equals today's SDPA path over
gathered blocks, and its block lists are what the compiled kernel needs: every key mask_mod lets a
query see lies in a block listed for that query's tile, and every block listed as full is visible
to every query of its tile in all of its keys (the compiled kernel evaluates no mask there; the
CPU path evaluates mask_mod everywhere, so only this check covers the lists)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from conveyor.model.attention_backends import flex_paged
from conveyor.model.attention import RowSpec, attend, build_metadata

CPU = torch.device("cpu")
NUM_CACHE_BLOCKS = 90


def make_rows(specs: list[tuple[int, int]], block_size: int, free: list[int], shared: list[int],
              first_sharing: int) -> list[RowSpec]:
    """specs: (new tokens, context length after them) per row, tokens packed in order; the `shared`
    blocks start the tables of the rows from `first_sharing` on (a cached prefix held by several rows)."""
    rows, start = [], 0
    for i, (num_query, context) in enumerate(specs):
        prefix = shared[: -(-context // block_size)] if i >= first_sharing else []
        table = prefix + [free.pop() for _ in range(-(-context // block_size) - len(prefix))]
        rows.append(RowSpec(token_start=start, num_query=num_query, context_len=context, block_table=table))
        start += num_query
    return rows


# Decode rows at block edges and deep in context; prompt chunks: whole prompts, later chunks after a
# cached prefix, chunks of more than one 64-query tile.
SPECS = [(1, 1), (1, 16), (1, 17), (1, 150), (5, 5), (23, 40), (17, 17), (2, 2), (70, 90), (130, 200)]


def _case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[RowSpec]]:
    gen = torch.Generator().manual_seed(seed)
    blocks = NUM_CACHE_BLOCKS * 16 // block_size
    shape = (blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(kv_dtype), torch.randn(shape, generator=gen).to(kv_dtype)
    free = torch.randperm(blocks, generator=gen).tolist()
    shared = [free.pop() for _ in range(2)]
    rows = make_rows(SPECS, block_size, free, shared, first_sharing=6)
    q = torch.randn(sum(n for n, _ in SPECS), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, rows


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, None),    # GQA, SmolLM2's shape
    (4, 4, 32, 8, None),     # no GQA, small blocks
    (8, 2, 16, 16, 7),       # a window inside one block
    (4, 1, 32, 16, 40),      # a window across blocks (gemma3 / mistral style), one KV head
    (6, 2, 16, 32, 24),
])
def test_flex_equals_the_sdpa_path(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                                   window: int | None) -> None:
    q, k_cache, v_cache, rows = _case(num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    scale = head_dim ** -0.5
    for layer_window in {None, window}:   # a model with windows keeps global layers too
        want = attend(q, k_cache, v_cache, build_metadata(rows, block_size, window, CPU), scale, layer_window)
        meta = build_metadata(rows, block_size, window, CPU, flex_cache_blocks=k_cache.shape[0])
        assert meta.flex is not None and not meta.groups
        got = attend(q, k_cache, v_cache, meta, scale, layer_window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_16_bit_cache_beside_float32_queries() -> None:
    q, k_cache, v_cache, rows = _case(9, 3, 64, 16, torch.float16, seed=2)
    want = attend(q, k_cache.float(), v_cache.float(), build_metadata(rows, 16, None, CPU), 0.125, None)
    got = attend(q, k_cache, v_cache, build_metadata(rows, 16, None, CPU, flex_cache_blocks=k_cache.shape[0]),
                 0.125, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)   # both read the cache as float32


@pytest.mark.parametrize("block_size,window", [(16, None), (16, 7), (8, 40), (32, 24)])
def test_block_lists_cover_mask_mod_and_full_blocks_need_no_mask(block_size: int, window: int | None) -> None:
    _, k_cache, _, rows = _case(4, 2, 16, block_size, torch.float32, seed=1)
    num_keys = k_cache.shape[0] * block_size
    meta = build_metadata(rows, block_size, window, CPU, flex_cache_blocks=k_cache.shape[0])
    for group in meta.flex.groups:
        block_mask = group.masks[window]
        num_rows, num_query_slots = group.query_index.shape
        dense = flex_paged.dense_mask(block_mask, num_rows, num_query_slots, num_keys, CPU)[:, 0]   # (B, Lq, S)
        real = torch.zeros(num_rows * num_query_slots, dtype=torch.bool)
        real[group.out_rows] = True
        real = real.view(num_rows, num_query_slots)
        kv_num, kv_idx, full_num, full_idx = (t[:, 0] for t in block_mask.as_tuple()[2:6])
        q_block = group.q_block
        for b in range(num_rows):
            for tile in range(kv_num.shape[1]):
                queries = slice(tile * q_block, (tile + 1) * q_block)
                partial = kv_idx[b, tile, : kv_num[b, tile]].tolist()
                full = full_idx[b, tile, : full_num[b, tile]].tolist()
                assert len(set(partial + full)) == len(partial) + len(full), "a block listed twice"
                seen = dense[b, queries][real[b, queries]].view(-1, num_keys // block_size, block_size)
                visible_blocks = seen.any(dim=2).any(dim=0).nonzero().flatten().tolist()
                assert set(visible_blocks) <= set(partial + full), (b, tile)
                for block in full:
                    assert seen[:, block].all(), f"block {block} listed full but masked somewhere"


def test_eager_flex_attention_reads_the_same_block_masks() -> None:
    """torch's own flex_attention (eager) takes the block masks and gives what the CPU path gives."""
    q, k_cache, v_cache, rows = _case(4, 2, 16, 16, torch.float32, seed=3)
    rows = rows[3:6]   # a decode row and two chunks: one group each, small enough for eager flex
    meta = build_metadata(rows, 16, 24, CPU, flex_cache_blocks=k_cache.shape[0])
    keys = k_cache.view(1, -1, 2, 16).transpose(1, 2)
    values = v_cache.view(1, -1, 2, 16).transpose(1, 2)
    for group in meta.flex.groups:
        qg = q[group.query_index].transpose(1, 2)
        for window in (None, 24):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # flex_attention's note that eager is slow
                theirs = flex_attention(qg, keys, values, block_mask=group.masks[window], scale=0.25, enable_gqa=True)
            ours = flex_paged.dense_flex(qg, keys, values, group.masks[window], 0.25)
            real = group.out_rows
            torch.testing.assert_close(ours.transpose(1, 2).reshape(-1, 4, 16)[real],
                                       theirs.transpose(1, 2).reshape(-1, 4, 16)[real], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_flex_on_the_cpu_visits_only_the_listed_blocks() -> None:
    """torch.compile'd flex_attention (inductor's CPU template, ~1 min to compile on 2 cores) skips
    unlisted blocks and evaluates no mask on full ones, as the GPU kernel does; dynamic sizes, so a
    step of other sizes reuses the compile. Its template wants the block lists as wide as the cache."""
    compiled = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    for seed, window in ((0, None), (1, 40), (2, 40)):
        q, k_cache, v_cache, rows = _case(4, 2, 16, 16, torch.float32, seed=seed)
        if seed == 2:
            rows = rows[:4] + rows[6:9]
        num_blocks = k_cache.shape[0]
        meta = build_metadata(rows, 16, window, CPU, flex_cache_blocks=num_blocks)
        keys, values = (c.view(1, -1, 2, 16).transpose(1, 2) for c in (k_cache, v_cache))
        for group in meta.flex.groups:
            qg = q[group.query_index].transpose(1, 2)
            for layer_window in {None, window}:
                mask = group.masks[layer_window]
                lists = list(mask.as_tuple()[2:6])
                for i in (1, 3):
                    lists[i] = torch.nn.functional.pad(lists[i], (0, num_blocks - lists[i].shape[-1]))
                wide = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod,
                                                seq_lengths=mask.seq_lengths, compute_q_blocks=False)
                got = compiled(qg, keys, values, block_mask=wide, scale=0.25, enable_gqa=True)
                want = flex_paged.dense_flex(qg, keys, values, mask, 0.25)
                real = group.out_rows
                torch.testing.assert_close(got.transpose(1, 2).reshape(-1, 4, 16)[real],
                                           want.transpose(1, 2).reshape(-1, 4, 16)[real], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("dtype", (torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window", [
    (8, 2, 64, 16, 40),
    pytest.param(9, 3, 64, 32, None, marks=pytest.mark.slow),   # each shape compiles anew: ~10 s each
])
def test_compiled_flex_on_the_gpu_equals_the_sdpa_path(num_heads: int, num_kv_heads: int, head_dim: int,
                                                       block_size: int, window: int | None, dtype: torch.dtype) -> None:
    """The compiled kernel visits only the listed blocks, evaluating mask_mod on the partial ones."""
    cuda = torch.device("cuda")
    q, k_cache, v_cache, rows = _case(num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    q, k_cache, v_cache = (t.to(cuda, dtype) for t in (q, k_cache, v_cache))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # The window's masks only (each mask class compiles anew): the engine's GPU test runs global layers.
    want = attend(q, k_cache, v_cache, build_metadata(rows, block_size, window, cuda), head_dim ** -0.5, window)
    meta = build_metadata(rows, block_size, window, cuda, flex_cache_blocks=k_cache.shape[0])
    got = attend(q, k_cache, v_cache, meta, head_dim ** -0.5, window)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_an_int8_cache_is_refused() -> None:
    q, k_cache, v_cache, rows = _case(4, 2, 16, 16, torch.float32)
    meta = build_metadata(rows, 16, None, CPU, flex_cache_blocks=k_cache.shape[0])
    with pytest.raises(ValueError, match="float KV cache"):
        attend(q, k_cache.to(torch.int8), v_cache.to(torch.int8), meta, 0.25, None)
