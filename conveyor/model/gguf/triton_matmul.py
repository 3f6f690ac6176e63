"""The Triton kernel of gpu_matmul.py (imported only where Triton is installed): one program per BLOCK_N
output channels and ROWS rows of x walks K in chunks of 256 weights, dequantizes the chunk's
(BLOCK_N, 256) tile of GGUF blocks in registers and multiplies it with those rows on the tensor cores."""

import triton
import triton.language as tl


@triton.jit
def f16(p):  # noqa: ANN001, ANN202 - the little-endian float16 at byte pointers p, as float32
    lo = tl.load(p).to(tl.uint16)
    hi = tl.load(p + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def tile(row, e, FMT: tl.constexpr, SIZE: tl.constexpr):  # noqa: ANN001, ANN202
    """Weights e (0..255 of this chunk, (1, 256)) of the rows at byte pointers `row` ((BN, 1)); SIZE:
    bytes per block."""
    if FMT <= 3:   # blocks of 32: row points at this chunk's first block
        blk = row + (e // 32) * SIZE
        i = e % 32
        d = f16(blk)
        if FMT == 3:
            w = d * tl.load(blk + 2 + i).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            shift = (i // 16) * 4
            if FMT == 0:
                q = (tl.load(blk + 2 + i % 16) >> shift) & 15
                w = d * (q.to(tl.int32) - 8).to(tl.float32)
            elif FMT == 1:
                q = (tl.load(blk + 4 + i % 16) >> shift) & 15
                w = d * q.to(tl.float32) + f16(blk + 2)
            else:
                q = (tl.load(blk + 6 + i % 16) >> shift) & 15
                high = (tl.load(blk + 2 + i // 8) >> (i % 8)) & 1
                w = d * ((q | (high << 4)).to(tl.int32) - 16).to(tl.float32)
    elif FMT <= 5:   # Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit scales and mins in 12 bytes at byte 4
        j = e // 32
        lo4 = j < 4
        a = tl.load(row + 4 + j + 4).to(tl.int32)
        b = tl.load(row + 4 + tl.where(lo4, j, j - 4)).to(tl.int32)
        c = tl.load(row + 4 + j).to(tl.int32)
        sc = tl.where(lo4, c & 63, (a & 15) | ((b >> 6) << 4)).to(tl.float32)
        mn = tl.where(lo4, a & 63, (a >> 4) | ((c >> 6) << 4)).to(tl.float32)
        start = 16 if FMT == 4 else 48
        q = (tl.load(row + start + (j // 2) * 32 + e % 32) >> ((j % 2) * 4)) & 15
        if FMT == 5:
            q = q | (((tl.load(row + 16 + e % 32) >> j) & 1) << 4)
        w = (f16(row) * sc) * q.to(tl.float32) - f16(row + 2) * mn
    else:   # Q6_K: low nibbles at 0, high 2 bits at 128, int8 scales per 16 at 192, d at 208
        h = e // 128
        r = e % 128
        low = (tl.load(row + h * 64 + r % 64) >> ((r // 64) * 4)) & 15
        high = (tl.load(row + 128 + h * 32 + r % 32) >> ((r // 32) * 2)) & 3
        q = ((low | (high << 4)).to(tl.int32) - 32).to(tl.float32)
        scale = tl.load(row + 192 + e // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = (f16(row + 208) * scale) * q
    return w


@triton.jit
def matmul(w_ptr, x_ptr, y_ptr, T, N, K, row_bytes, chunk_bytes, num_chunks,  # noqa: ANN001, ANN202
           FMT: tl.constexpr, SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """y (T, N) = x (T, K) @ W.T, W (N, K) in GGUF blocks of type FMT; program (i, j): outputs
    i * BLOCK_N.. of rows j * ROWS.."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.arange(0, 256)
    t = (tl.program_id(1) * ROWS + tl.arange(0, ROWS)).to(tl.int64)   # t * K, t * N can pass 2**31
    n_ok = n < N
    rows = w_ptr + tl.where(n_ok, n, 0).to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for kc in range(0, num_chunks):   # chunks of 256 along K, the last one masked
        k = kc * 256 + e
        k_ok = k < K
        w = tile(rows + kc * chunk_bytes, tl.where(k_ok, e, 0)[None, :], FMT, SIZE)
        w = tl.where(n_ok[:, None] & k_ok[None, :], w, 0.0).to(x_ptr.dtype.element_ty)
        x = tl.load(x_ptr + t[None, :] * K + k[:, None], mask=(t[None, :] < T) & k_ok[:, None], other=0.0)
        acc += tl.dot(w, x)
    tl.store(y_ptr + t[None, :] * N + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (t[None, :] < T))
