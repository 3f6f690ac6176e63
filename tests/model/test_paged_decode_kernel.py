"""The fused C decode kernel equals the torch path of paged attention."""

from __future__ import annotations

import pytest
import torch

from conveyor import kernels
from conveyor.model.attention import RowSpec, build_metadata, paged_attention

pytestmark = pytest.mark.skipif(not kernels.has_paged_decode(), reason="no C compiler")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window",
                         [(9, 3, 64, 16, None), (4, 4, 32, 8, None), (8, 2, 16, 16, 7), (6, 1, 128, 4, None)])
def test_kernel_matches_torch_path(num_heads, num_kv_heads, head_dim, block_size, window) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = 200
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    context_lens = [1, 2, block_size, block_size + 1, 37, 100]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    rows = []
    for i, ctx in enumerate(context_lens):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        rows.append(RowSpec(token_start=i, num_query=1, context_len=ctx, block_table=table))
    q = torch.randn(len(rows), num_heads, head_dim, generator=gen)
    k = torch.randn(len(rows), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(rows), num_kv_heads, head_dim, generator=gen)
    outs = []
    for use_kernel in (False, True):
        meta = build_metadata(rows, block_size, window, torch.device("cpu"), use_kernel=use_kernel)
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim ** -0.5, window))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_unsupported_shape_is_refused() -> None:
    q = torch.randn(1, 40, 8)
    cache = torch.randn(2, 4, 2, 8)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                             1.0, None)
