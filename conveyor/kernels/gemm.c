/* Packed-weight matrix multiply for linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias) (+ residual).
 *
 * Weights are packed once at load into panels of NR = 32 output channels, so a panel streams
 * through memory contiguously and each weight vector loaded serves every row of x in the tile:
 *   float32:  w[N/32][K][32]
 *   bfloat16: w[N/32][K/2][32][2]   (pairs along K: the operand layout of vdpbf16ps)
 * N is padded to a multiple of 32 with zero weights; only the first N columns of y are written.
 * With a residual r (which y may overwrite in place) the product is added to it in the same pass, so
 * the decoder's skip connections cost no extra sweep over the activations.
 *
 * Each output is accumulated over k in one fixed order whatever M is and wherever its row falls in
 * a tile, so a request's result never depends on the rest of its batch (batch invariance).
 * Code paths: AVX-512 (+BF16), AVX2+FMA, portable C; chosen by the flags the library is built with.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define NR 32
#ifndef PF_DIST
#define PF_DIST 0
#endif
#ifndef PF_HINT
#define PF_HINT 2
#endif
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#define MC 64   /* rows of x per block: the block stays in L2 while the weight panels stream past */

#if KN_AVX512
#define HAVE_AVX512 1
#define MR_F32 8
#elif KN_AVX2
#define HAVE_AVX2 1
#define MR_F32 6
#else
#define MR_F32 4
#endif

#if KN_AVX512_BF16
#define HAVE_AVX512BF16 1
#define MR_BF16 8
#else
#define MR_BF16 4
#endif

#define INLINE static inline __attribute__((always_inline))

/* The build allows reassociation (for vectorised loops elsewhere); this keeps (product + bias) rounded
 * before the residual is added, as an unfused add would. */
static inline float rounded(float v) {
    __asm__("" : "+g"(v));
    return v;
}

/* ------------------------------------------------------------------ float32 tiles */

#if defined(HAVE_AVX512)
INLINE void tile_f32(const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                     const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int64_t nc) {
    __m512 acc[MR_F32][2];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(w + k * NR), w1 = _mm512_loadu_ps(w + k * NR + 16);
#if PF_DIST > 0
        if (mr <= PF_ROWS) {
            __builtin_prefetch(w + (k + PF_DIST) * NR, 0, PF_HINT);
            __builtin_prefetch(w + (k + PF_DIST) * NR + 16, 0, PF_HINT);
        }
#endif
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    const __mmask16 m0 = nc >= 16 ? 0xffff : (__mmask16)((1u << nc) - 1);
    const __mmask16 m1 = nc >= 32 ? 0xffff : nc <= 16 ? 0 : (__mmask16)((1u << (nc - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) { b0 = _mm512_maskz_loadu_ps(m0, bias); b1 = _mm512_maskz_loadu_ps(m1, bias + 16); }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        __m512 v0 = _mm512_add_ps(acc[r][0], b0), v1 = _mm512_add_ps(acc[r][1], b1);
        __asm__("" : "+v"(v0), "+v"(v1));   /* see rounded() */
        if (res) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, res + r * ldr));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, res + r * ldr + 16));
        }
        _mm512_mask_storeu_ps(y + r * ldy, m0, v0);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, v1);
    }
}
#elif defined(HAVE_AVX2)
/* 16 registers: the 32 columns go in two passes of 16, so 6 rows x 2 vectors of accumulators fit. */
INLINE void tile_f32(const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                     const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int64_t nc) {
    for (int half = 0; half < 2; half++) {
        const int64_t cols = nc - half * 16;
        if (cols <= 0) break;
        __m256 acc[MR_F32][2];
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float *wh = w + half * 16;
        for (int64_t k = 0; k < K; k++) {
            const __m256 w0 = _mm256_loadu_ps(wh + k * NR), w1 = _mm256_loadu_ps(wh + k * NR + 8);
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
                acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            }
        }
        /* Unrolled like the loops above: a run-time index would keep the accumulators in memory. */
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            float out[16];
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
            float *yr = y + r * ldy + half * 16;
            const float *rr = res ? res + r * ldr + half * 16 : 0;
            for (int64_t j = 0; j < cols && j < 16; j++) {
                const float v = rounded(out[j] + (bias ? bias[half * 16 + j] : 0.f));
                yr[j] = rr ? v + rr[j] : v;
            }
        }
    }
}

/* Few rows: all 32 columns in one pass, so a panel streams from memory once and contiguously (the
 * 16-column passes above read every other cache line and stream at about 2/3 of the bandwidth).
 * Same arithmetic per output as tile_f32, so either may compute any row. */
#define MR_F32_WIDE 3
#define WIDE_MAX_ROWS 64   /* measured on Zen 3: wide tiles win up to M = 64, the 6 x 16 ones from 256 */
INLINE void tile_f32_wide(const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                          const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int64_t nc) {
    __m256 acc[MR_F32_WIDE][4];
#pragma GCC unroll 3
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 xv[MR_F32_WIDE];
#pragma GCC unroll 3
        for (int r = 0; r < mr; r++) xv[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(w + k * NR + 8 * j);
#pragma GCC unroll 3
            for (int r = 0; r < mr; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
#pragma GCC unroll 3
    for (int r = 0; r < mr; r++) {
        float out[NR];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, acc[r][j]);
        float *yr = y + r * ldy;
        const float *rr = res ? res + r * ldr : 0;
        for (int64_t j = 0; j < nc; j++) {
            const float v = rounded(out[j] + (bias ? bias[j] : 0.f));
            yr[j] = rr ? v + rr[j] : v;
        }
    }
}
#else
INLINE void tile_f32(const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                     const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int64_t nc) {
    float acc[MR_F32][NR];
    memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * ldx + k];
            for (int j = 0; j < NR; j++) acc[r][j] += xv * w[k * NR + j];
        }
    for (int r = 0; r < mr; r++)
        for (int64_t j = 0; j < nc; j++) {
            const float v = rounded(acc[r][j] + (bias ? bias[j] : 0.f));
            y[r * ldy + j] = res ? v + res[r * ldr + j] : v;
        }
}
#endif

/* ------------------------------------------------------------------ bfloat16 tiles (f32 accumulation) */

#if defined(HAVE_AVX512BF16)
INLINE __m512 widen_bf16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

INLINE void tile_bf16(const int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K,
                      const uint16_t *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int64_t nc) {
    __m512 acc[MR_BF16][2];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * NR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * NR + NR);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kp, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
        }
    }
    const __mmask16 m0 = nc >= 16 ? 0xffff : (__mmask16)((1u << nc) - 1);
    const __mmask16 m1 = nc >= 32 ? 0xffff : nc <= 16 ? 0 : (__mmask16)((1u << (nc - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = widen_bf16(_mm256_maskz_loadu_epi16(m0, bias));
        b1 = widen_bf16(_mm256_maskz_loadu_epi16(m1, bias + 16));
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        __m256i v0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0));
        __m256i v1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1));
        if (res) {  /* the product is rounded to bf16 before the residual add, as an unfused bf16 add would */
            v0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(widen_bf16(v0), widen_bf16(_mm256_maskz_loadu_epi16(m0, res + r * ldr))));
            v1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(widen_bf16(v1), widen_bf16(_mm256_maskz_loadu_epi16(m1, res + r * ldr + 16))));
        }
        _mm256_mask_storeu_epi16(y + r * ldy, m0, v0);
        _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, v1);
    }
}
#else
/* No native bf16 dot product: widen to float32 (exact) and multiply-add, pair by pair. */
INLINE void tile_bf16(const int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K,
                      const uint16_t *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int64_t nc) {
    float acc[MR_BF16][NR];
    memset(acc, 0, sizeof(acc));
    for (int64_t kp = 0; kp < K / 2; kp++) {
        float wf[2][NR];
        for (int j = 0; j < NR; j++) {
            wf[0][j] = bf16_to_f32(w[kp * 2 * NR + 2 * j]);
            wf[1][j] = bf16_to_f32(w[kp * 2 * NR + 2 * j + 1]);
        }
        for (int r = 0; r < mr; r++) {
            const float x0 = bf16_to_f32(x[r * ldx + 2 * kp]), x1 = bf16_to_f32(x[r * ldx + 2 * kp + 1]);
            for (int j = 0; j < NR; j++) acc[r][j] += x0 * wf[0][j] + x1 * wf[1][j];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int64_t j = 0; j < nc; j++) {
            const uint16_t v = f32_to_bf16(acc[r][j] + (bias ? bf16_to_f32(bias[j]) : 0.f));
            y[r * ldy + j] = res ? f32_to_bf16(bf16_to_f32(v) + bf16_to_f32(res[r * ldr + j])) : v;
        }
}
#endif

/* ------------------------------------------------------------------ drivers */

/* A switch over constant row counts, so each tile's loops unroll and its accumulators stay in registers. */
#define DISPATCH(TILE, MR_MAX, mr, ...)                                            \
    switch (mr) {                                                                  \
        case 1: TILE(1, __VA_ARGS__); break;                                       \
        case 2: TILE(2, __VA_ARGS__); break;                                       \
        case 3: TILE(3, __VA_ARGS__); break;                                       \
        case 4: if (MR_MAX >= 4) TILE(4 <= MR_MAX ? 4 : 1, __VA_ARGS__); break;    \
        case 5: if (MR_MAX >= 5) TILE(5 <= MR_MAX ? 5 : 1, __VA_ARGS__); break;    \
        case 6: if (MR_MAX >= 6) TILE(6 <= MR_MAX ? 6 : 1, __VA_ARGS__); break;    \
        case 7: if (MR_MAX >= 7) TILE(7 <= MR_MAX ? 7 : 1, __VA_ARGS__); break;    \
        default: if (MR_MAX >= 8) TILE(8 <= MR_MAX ? 8 : 1, __VA_ARGS__); break;   \
    }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Blocks of at most MC rows, equal in size: 65 rows go as 33 + 32, not 64 + a lone row that would
 * stream every weight again through the slowest tile. */
static inline int64_t block_rows(int64_t M) {
    const int64_t blocks = (M + MC - 1) / MC;
    return blocks ? (M + blocks - 1) / blocks : 1;
}

typedef struct {
    const void *x, *w, *bias, *res;
    void *y;
    int64_t ldx, ldr, ldy, M, N, K, mc, panels;
} gemm_job;

/* Work items are (block of rows, panel of NR columns), block-major. */
static void gemm_f32_item(void *arg, int64_t item) {
    const gemm_job *j = arg;
    const float *x = j->x, *w = j->w, *bias = j->bias, *res = j->res;
    float *y = j->y;
    const int64_t ldx = j->ldx, ldr = j->ldr, ldy = j->ldy, M = j->M, N = j->N, K = j->K, panels = j->panels;
    const int64_t p = item % panels, m_end = min64(M, (item / panels + 1) * j->mc);
    const int64_t n0 = p * NR, nc = min64(NR, N - n0);
    const float *wp = w + p * K * NR;
    int64_t m = (item / panels) * j->mc;
#if defined(MR_F32_WIDE)
    if (M <= WIDE_MAX_ROWS) {
        for (; m < m_end; m += MR_F32_WIDE) {
            const int mr = (int)min64(MR_F32_WIDE, m_end - m);
            DISPATCH(tile_f32_wide, MR_F32_WIDE, mr, x + m * ldx, ldx, wp, K, bias ? bias + n0 : 0,
                     res ? res + m * ldr + n0 : 0, ldr, y + m * ldy + n0, ldy, nc);
        }
        return;
    }
#endif
    for (; m < m_end; m += MR_F32) {
        const int mr = (int)min64(MR_F32, m_end - m);
        DISPATCH(tile_f32, MR_F32, mr, x + m * ldx, ldx, wp, K, bias ? bias + n0 : 0, res ? res + m * ldr + n0 : 0,
                 ldr, y + m * ldy + n0, ldy, nc);
    }
}

static void gemm_bf16_item(void *arg, int64_t item) {
    const gemm_job *j = arg;
    const uint16_t *x = j->x, *w = j->w, *bias = j->bias, *res = j->res;
    uint16_t *y = j->y;
    const int64_t ldx = j->ldx, ldr = j->ldr, ldy = j->ldy, M = j->M, N = j->N, K = j->K, panels = j->panels;
    const int64_t p = item % panels, m_end = min64(M, (item / panels + 1) * j->mc);
    const int64_t n0 = p * NR, nc = min64(NR, N - n0);
    const uint16_t *wp = w + p * K * NR;
    for (int64_t m = (item / panels) * j->mc; m < m_end; m += MR_BF16) {
        const int mr = (int)min64(MR_BF16, m_end - m);
        DISPATCH(tile_bf16, MR_BF16, mr, x + m * ldx, ldx, wp, K, bias ? bias + n0 : 0, res ? res + m * ldr + n0 : 0,
                 ldr, y + m * ldy + n0, ldy, nc);
    }
}

static void run(pool_fn item, const void *x, int64_t ldx, const void *w, const void *bias, const void *res,
                int64_t ldr, void *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    const int64_t mc = block_rows(M), panels = (N + NR - 1) / NR, blocks = (M + mc - 1) / mc;
    gemm_job job = {x, w, bias, res, y, ldx, ldr, ldy, M, N, K, mc, panels};
    pool_for(panels * blocks, item, &job, num_threads);
}

int gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, const float *res, int64_t ldr,
             float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    run(gemm_f32_item, x, ldx, w, bias, res, ldr, y, ldy, M, N, K, num_threads);
    return 0;
}

/* K must be even (the packing pairs it). */
int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, const uint16_t *res,
              int64_t ldr, uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    if (K % 2) return -1;
    run(gemm_bf16_item, x, ldx, w, bias, res, ldr, y, ldy, M, N, K, num_threads);
    return 0;
}

/* Which code paths this build took, for logs and tests: bit 0 AVX2, bit 1 AVX-512, bit 2 AVX-512 BF16. */
int gemm_isa(void) {
    int isa = 0;
#if defined(HAVE_AVX2)
    isa |= 1;
#endif
#if defined(HAVE_AVX512)
    isa |= 2;
#endif
#if defined(HAVE_AVX512BF16)
    isa |= 4;
#endif
    return isa;
}
