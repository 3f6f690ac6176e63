"""The 8-bit KV cache: the C kernel reads int8 codes and their scales in place, its scores integer dots of
int16 query codes with the key codes: it equals a torch reference that quantizes the queries the same way
(exact integer scores), and float attention over the dequantized cache within the queries' rounding; the
C writer quantizes exactly as torch's does; every ISA build agrees, the SIMD ones to the bit."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conveyor import kernels
from conveyor.kernels.build import builds
from conveyor.model import kv_quant
from conveyor.model.attention import AttentionMetadata, RowSpec, attend, build_metadata, write_cache

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")
CPU = torch.device("cpu")
NUM_BLOCKS = 120


class Int8Cache:
    """One layer's int8 cache twice over (transposed keys for the kernel, plain for torch), holding the
    same random keys and values, and the float cache they dequantize to."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
        # Heads of unlike magnitudes, and one all-zero vector (its scale is 0).
        k = torch.randn(shape, generator=gen) * torch.linspace(0.1, 8, num_kv_heads)[:, None]
        v = torch.randn(shape, generator=gen)
        k[0, 0, 0] = 0
        nbytes = kv_quant.block_bytes(block_size, num_kv_heads, head_dim)
        self.blocks = torch.zeros(2, NUM_BLOCKS, nbytes, dtype=torch.int8)
        self.plain_blocks = torch.zeros(2, NUM_BLOCKS, nbytes, dtype=torch.int8)
        self.kernel = kv_quant.code_views(self.blocks, block_size, num_kv_heads, head_dim, True)
        self.plain = kv_quant.code_views(self.plain_blocks, block_size, num_kv_heads, head_dim, False)
        (k_codes, k_scales), (v_codes, v_scales) = kv_quant.quantize(k), kv_quant.quantize(v)
        self.k_codes, self.k_scales = k_codes, k_scales
        self.kernel[0].copy_(k_codes.permute(0, 2, 3, 1))
        kv_quant.scales_of(self.kernel[0], True).copy_(k_scales.permute(0, 2, 1))
        for codes, scales, view in ((v_codes, v_scales, self.kernel[1]), (k_codes, k_scales, self.plain[0]),
                                    (v_codes, v_scales, self.plain[1])):
            view.copy_(codes)
            kv_quant.scales_of(view, False).copy_(scales)
        self.floats = (kv_quant.dequantize(k_codes, k_scales, torch.float32),
                       kv_quant.dequantize(v_codes, v_scales, torch.float32))
        self.free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()


def rows_for(specs: list[tuple[int, int]], block_size: int, free: list[int]) -> list[RowSpec]:
    rows, start = [], 0
    for num_query, ctx in specs:
        rows.append(RowSpec(start, num_query, ctx, [free.pop() for _ in range(-(-ctx // block_size))]))
        start += num_query
    return rows


def run(q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], rows: list[RowSpec], block_size: int,
        window: int | None, tile: int) -> torch.Tensor:
    meta = build_metadata(rows, block_size, window, CPU, kernel_tile_size=tile)
    return attend(q, caches[0], caches[1], meta, q.shape[-1] ** -0.5, window)


def quantized_reference(q: torch.Tensor, cache: Int8Cache, rows: list[RowSpec], block_size: int,
                        window: int | None) -> torch.Tensor:
    """Attention as the kernel computes it: each query head as int16 codes in blocks of 16 (absmax / 32767),
    its integer dots with the key codes exact, each block's times (its query scale x (key scale x softmax
    scale)) in float32, summed block after block; then the softmax and the dequantized values in float64."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, nb = cache.k_codes.shape[2], head_dim // 16
    scale = torch.tensor(head_dim ** -0.5, dtype=torch.float32)
    qf = q.float().view(num_tokens, num_heads, nb, 16)
    qd = qf.abs().amax(-1) / 32767                                                    # (T, H, nb)
    qc = torch.where(qd[..., None] > 0, qf / qd[..., None], 0.0).round().double()     # (T, H, nb, 16)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for r in rows:
        table = torch.tensor(r.block_table)
        kc = cache.k_codes[table].reshape(-1, num_kv_heads, nb, 16)[:r.context_len].double()
        ks = cache.k_scales[table].reshape(-1, num_kv_heads)[:r.context_len].float() * scale      # (C, KV)
        v = cache.floats[1][table].reshape(-1, num_kv_heads, head_dim)[:r.context_len].double()
        heads = torch.arange(num_heads) // (num_heads // num_kv_heads)
        for j in range(r.num_query):
            token, end = r.token_start + j, r.context_len - r.num_query + j + 1
            lo = max(0, end - window) if window else 0
            exact = torch.einsum("hbd,thbd->bht", qc[token], kc[lo:end, heads]).float()      # (nb, H, keys)
            for b in range(nb):   # a fused multiply-add per block after the first (float64 holds it exactly)
                f = qd[token][:, b, None] * ks[lo:end, heads].t()
                scores = exact[b] * f if b == 0 else (exact[b].double() * f.double() + scores.double()).float()
            weights = torch.softmax(scores.double(), dim=-1)
            out[token] = torch.einsum("ht,thd->hd", weights, v[lo:end, heads])
    return out


SHAPES = [(14, 2, 64, 16, None), (9, 3, 80, 16, None), (8, 2, 16, 16, 7), (6, 1, 128, 4, None), (4, 4, 80, 8, 5),
          (16, 2, 128, 32, None)]


def mixed_step(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int = 1):
    """A cache and one step's rows: decode rows at block edges and off them, prompt chunks (whole prompts, a
    later chunk, one past a tile), contexts that are no multiple of the block size, and their queries."""
    cache = Int8Cache(num_kv_heads, head_dim, block_size)
    specs = [(1, 1), (1, block_size), (1, block_size + 1), (1, 100), (5, 5), (23, 40), (17, 17), (2, 2), (1, 77)]
    rows = rows_for(specs, block_size, cache.free)
    q = torch.randn(sum(n for n, _ in specs), num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    tile = kernels.attention_tile_size(num_heads, num_kv_heads, head_dim, block_size)
    assert tile > 0
    return cache, rows, q, tile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window", SHAPES)
def test_kernel_equals_the_reference_with_quantized_queries(num_heads, num_kv_heads, head_dim, block_size, window,
                                                            dtype) -> None:
    cache, rows, q, tile = mixed_step(num_heads, num_kv_heads, head_dim, block_size)
    ours = run(q.to(dtype), cache.kernel, rows, block_size, window, tile)
    reference = quantized_reference(q.to(dtype), cache, rows, block_size, window)
    if dtype == torch.float32:   # the same scores: only the softmax's and the sums' float32 rounding differ
        torch.testing.assert_close(ours.double(), reference, atol=2e-6, rtol=2e-6)
    else:                        # the output's own rounding to bfloat16
        torch.testing.assert_close(ours, reference.to(dtype), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window",
                         [(9, 3, 64, 16, None), (14, 2, 64, 16, None), (8, 2, 16, 16, 7), (6, 1, 128, 4, None),
                          (4, 4, 32, 8, None)])
def test_kernel_is_close_to_float_attention_over_the_dequantized_cache(num_heads, num_kv_heads, head_dim, block_size,
                                                                       window, dtype) -> None:
    cache, rows, q, tile = mixed_step(num_heads, num_kv_heads, head_dim, block_size)
    ours = run(q.to(dtype), cache.kernel, rows, block_size, window, tile)
    reference = run(q.to(dtype).float(), cache.floats, rows, block_size, window, 0)
    # float32: the queries' int16 rounding (half of absmax / 32767 a value) on keys up to 8 times randn
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)
    # torch's path reads the int8 cache too (dequantizing what it gathers; in bf16 its keys round too).
    tol = 2e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(run(q.to(dtype), cache.plain, rows, block_size, window, 0).float(), reference,
                               atol=tol, rtol=tol)


def test_a_query_gives_the_same_bits_in_any_step() -> None:
    """Decode rows read the codes in place, prompt chunks widen them first: the same bits either way."""
    num_heads, num_kv_heads, head_dim, block_size, n = 9, 3, 64, 16, 40
    cache = Int8Cache(num_kv_heads, head_dim, block_size, seed=3)
    table = [cache.free.pop() for _ in range(3)]
    q = torch.randn(n, num_heads, head_dim, generator=torch.Generator().manual_seed(4))
    tile = kernels.attention_tile_size(num_heads, num_kv_heads, head_dim, block_size)
    whole = run(q, cache.kernel, [RowSpec(0, n, n, table)], block_size, None, tile)
    for chunk in (1, 3, 16, 25):
        for first in range(0, n, chunk):
            size = min(chunk, n - first)
            other = RowSpec(0, 1, 30, cache.free[:2])
            qq = torch.cat([torch.randn(1, num_heads, head_dim), q[first:first + size]])
            got = run(qq, cache.kernel, [other, RowSpec(1, size, first + size, table)], block_size, None, tile)
            assert torch.equal(got[1:], whole[first:first + size]), f"chunk {chunk} at {first}"


@pytest.mark.parametrize("is_bf16", [False, True])
def test_the_c_writer_quantizes_as_torch_does(is_bf16: bool) -> None:
    """rope_cache (the one-call layer's write) and write_cache (the op-by-op one) store the same bytes:
    codes and scales. The rotation is the identity here (cos 1, sin 0), so both get the same vectors."""
    lib = kernels.library().lib
    fn = lib.rope_cache
    fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, i64, i64, i64, p, p, p, i64, p, p, p, i64, p, p, ctypes.c_float, ctypes.c_int,
                   ctypes.c_int, i64]
    dtype = torch.bfloat16 if is_bf16 else torch.float32
    heads, kv_heads, head_dim, block_size, tokens = 4, 2, 64, 16, 37
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    qkv[4, heads * head_dim:(heads + 1) * head_dim] = 0   # a zero key: scale 0, codes 0
    slots = torch.randperm(8 * block_size, generator=gen)[:tokens]
    cos, sin = torch.ones(tokens, head_dim), torch.zeros(tokens, head_dim)
    nbytes = kv_quant.block_bytes(block_size, kv_heads, head_dim)
    ours, theirs = torch.zeros(2, 8, nbytes, dtype=torch.int8), torch.zeros(2, 8, nbytes, dtype=torch.int8)
    k_view, v_view = kv_quant.code_views(ours, block_size, kv_heads, head_dim, True)
    assert fn(qkv.clone().data_ptr(), qkv.shape[1], tokens, heads, kv_heads, head_dim, head_dim, cos.data_ptr(),
              sin.data_ptr(), None, 0, slots.data_ptr(), k_view.data_ptr(), v_view.data_ptr(), block_size, None, None,
              1e-6, int(is_bf16), kernels.decoder.KV_FORMATS[torch.int8], 1) == 0
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    k_plain, v_plain = kv_quant.code_views(theirs, block_size, kv_heads, head_dim, True)
    meta = AttentionMetadata(slots, [], build_metadata([RowSpec(0, 1, 1, [0])], block_size, None, CPU, 1).kernel)
    write_cache(k, v, k_plain, v_plain, meta)
    assert torch.equal(ours, theirs)
    assert kv_quant.scales_of(k_view, True).abs().max() > 0


VARIANTS = builds(kernels.cpu_features())   # native, and each narrower code path this CPU also runs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_code_path_matches_and_is_step_invariant(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """16, 8 or 4 lanes (AVX-512 VNNI, AVX2 with or without 256-bit VNNI, portable): each equals the reference
    and gives the same bits in any step; the SIMD paths give the native build's bits (the portable one has no
    fused multiply-adds in its softmax, so only its scores are the same)."""
    shape = (14, 2, 80, 16)
    cache, rows, q, tile = mixed_step(*shape)
    native = run(q, cache.kernel, rows, shape[3], None, tile)
    library = kernels.library_for(frozenset(VARIANTS[variant]))
    assert library is not None
    monkeypatch.setattr(kernels, "library", lambda: library)
    ours = run(q, cache.kernel, rows, shape[3], None, tile)
    if variant == "portable":
        torch.testing.assert_close(ours, native, atol=2e-6, rtol=2e-6)
    else:
        assert torch.equal(ours, native)
    test_kernel_equals_the_reference_with_quantized_queries(9, 3, 80, 16, None, torch.float32)
    test_kernel_equals_the_reference_with_quantized_queries(6, 1, 128, 4, None, torch.bfloat16)
    test_a_query_gives_the_same_bits_in_any_step()
    test_the_c_writer_quantizes_as_torch_does(False)
