"""The C attention kernel equals torch's padded attention, and a query's result never depends on its step."""

from __future__ import annotations

import pytest
import torch

from conveyor import kernels
from conveyor.model.attention import RowSpec, attend, build_metadata

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")
CPU = torch.device("cpu")


def make_cache(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (200, block_size, num_kv_heads, head_dim)
    free = torch.randperm(200, generator=gen).tolist()
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype), free


def rows_for(specs: list[tuple[int, int]], block_size: int, free: list[int]) -> list[RowSpec]:
    """specs: (new tokens, context length after them) per row; tokens packed in order."""
    rows, start = [], 0
    for num_query, ctx in specs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        rows.append(RowSpec(token_start=start, num_query=num_query, context_len=ctx, block_table=table))
        start += num_query
    return rows


def run(q, k_cache, v_cache, rows, block_size, window, tile):
    """k_cache (num_blocks, block_size, KV, D) as torch's path reads it; the kernel gets it transposed."""
    meta = build_metadata(rows, block_size, window, CPU, kernel_tile_size=tile)
    if tile:
        k_cache = k_cache.permute(0, 2, 3, 1).contiguous()
    return attend(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5, window)


# (query dtype, cache dtype): the cache is the activations' dtype, or a 16-bit one beside float32
# activations (quantized weights keep a float16 cache by default).
DTYPE_PAIRS = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float16),
               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window",
                         [(9, 3, 64, 16, None), (4, 4, 32, 8, None), (8, 2, 16, 16, 7), (6, 1, 128, 4, None)])
def test_kernel_matches_torch_path(num_heads, num_kv_heads, head_dim, block_size, window, dtype, kv_dtype) -> None:
    k_cache, v_cache, free = make_cache(num_heads, num_kv_heads, head_dim, block_size, kv_dtype or dtype)
    # Decode rows at block edges, and prompt chunks: whole prompts, a later chunk, one past a tile.
    specs = [(1, 1), (1, block_size), (1, block_size + 1), (1, 100), (5, 5), (23, 40), (17, 17), (2, 2)]
    rows = rows_for(specs, block_size, free)
    total = sum(n for n, _ in specs)
    q = torch.randn(total, num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    tile = kernels.attention_tile_size(num_heads, num_kv_heads, head_dim, block_size)
    assert tile > 0
    ours = run(q, k_cache, v_cache, rows, block_size, window, tile)
    theirs = run(q.float(), k_cache.float(), v_cache.float(), rows, block_size, window, 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2   # bf16: the output's own rounding
    torch.testing.assert_close(ours.float(), theirs, atol=tol, rtol=tol)
    # torch's own path reads a cache of another dtype too.
    torch_path = run(q, k_cache, v_cache, rows, block_size, window, 0)
    torch.testing.assert_close(torch_path.float(), theirs, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_PAIRS)
def test_a_query_gives_the_same_bits_in_any_step(dtype: torch.dtype, kv_dtype: torch.dtype | None) -> None:
    """One prompt of 40 tokens: whole, in chunks of other sizes beside other rows, or one token at a time
    as decode rows: every token's attention output is bit for bit the same."""
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    k_cache, v_cache, free = make_cache(num_heads, num_kv_heads, head_dim, block_size, kv_dtype or dtype, seed=3)
    table = [free.pop() for _ in range(3)]
    n = 40
    q = torch.randn(n, num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    tile = kernels.attention_tile_size(num_heads, num_kv_heads, head_dim, block_size)
    whole = run(q, k_cache, v_cache, [RowSpec(0, n, n, table)], block_size, None, tile)
    for chunk in (1, 3, 16, 25):
        for first in range(0, n, chunk):
            size = min(chunk, n - first)
            # An unrelated decode row ahead of the chunk shifts its packed position.
            other = RowSpec(0, 1, 30, [free[0], free[1]])
            qq = torch.cat([torch.randn(1, num_heads, head_dim).to(dtype), q[first:first + size]])
            got = run(qq, k_cache, v_cache, [other, RowSpec(1, size, first + size, table)], block_size, None, tile)
            assert torch.equal(got[1:], whole[first:first + size]), f"chunk {chunk} at {first}"


def test_unsupported_shape_is_refused() -> None:
    assert kernels.attention_tile_size(130, 2, 8, 4) == 0         # 65 query heads per kv head: too many
    assert kernels.attention_tile_size(8, 2, 512, 16) == 0        # head dim past the kernel's buffers
    q = torch.randn(1, 2, 512)
    cache = torch.randn(2, 4, 2, 512)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.paged_attention(q, cache.permute(0, 2, 3, 1), cache, torch.zeros(1, 1, dtype=torch.long), one, one + 1, one,
                                torch.tensor([0, 1]), 1.0, None, torch.empty_like(q))


NATIVE = kernels.cpu_features()
NARROWER = {"avx2": NATIVE & {"avx2", "fma", "f16c"}, "portable": frozenset()}


@pytest.mark.parametrize("variant", list(NARROWER))
def test_narrower_code_paths_match_and_are_step_invariant(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vector width follows the build (16, 8 or 4 lanes): the AVX2 and portable builds give the
    same answers and the same bits in any step as the native one does."""
    if variant == "avx2" and not {"avx2", "fma"} <= NATIVE:
        pytest.skip("this CPU has no AVX2")
    library = kernels.library_for(frozenset(NARROWER[variant]))
    assert library is not None
    monkeypatch.setattr(kernels, "library", lambda: library)
    test_kernel_matches_torch_path(9, 3, 64, 16, None, torch.float32, None)
    test_kernel_matches_torch_path(8, 2, 16, 16, 7, torch.bfloat16, None)
    test_kernel_matches_torch_path(9, 3, 64, 16, None, torch.float32, torch.float16)
    test_kernel_matches_torch_path(6, 1, 128, 4, None, torch.bfloat16, torch.float16)
    test_a_query_gives_the_same_bits_in_any_step(torch.float32, None)
    test_a_query_gives_the_same_bits_in_any_step(torch.float32, torch.float16)


@pytest.mark.parametrize("variant", ["native", "portable"])
def test_16_bit_conversions_round_as_torch_does(variant: str) -> None:
    """The cache's conversions (F16C, or plain C without it) equal torch's bit for bit: ties to even,
    subnormals, overflow to infinity, infinities and NaN."""
    library = kernels.library() if variant == "native" else kernels.library_for(frozenset())
    special = torch.tensor([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 6.0e-8, 2.98e-8, 2.99e-8,
                            5.96e-8, 1e-9, float("inf"), float("-inf"), 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8,
                            1 + 3 * 2**-8, 3.0e38, -3.4e38])
    values = torch.cat([special, torch.randn(5000) * torch.logspace(-9, 5, 5000)])
    for dtype in (torch.float16, torch.bfloat16):
        narrowed = kernels.convert(values, dtype, library)
        assert torch.equal(narrowed.view(torch.int16), values.to(dtype).view(torch.int16)), dtype
        assert torch.equal(kernels.convert(narrowed, torch.float32, library), narrowed.float())
    nan = kernels.convert(torch.tensor([float("nan")]), torch.float16, library)
    assert nan.isnan().all() and kernels.convert(nan, torch.float32, library).isnan().all()
