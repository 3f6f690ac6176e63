/* Matmul on weights kept in llama.cpp's Q5_0, Q4_K, Q5_K and Q6_K block formats, and the linear
 * layer that runs every quantized format (these and quant.c's Q8_0 / Q4_0 / Q4_1) as segments of
 * one output: a fused q/k/v whose parts differ in format quantizes its activations once.
 *
 * Weights are repacked once at load (kq_repack, straight from the file's blocks) into panels of
 * NR = 32 output channels. A panel is a run of units along K; a unit is a header of per-channel
 * scales then its 32-k blocks. Every block holds the low 4 bits of its codes as quant.c's Q4
 * layout, then the high bits (Q5: 1, Q6: 2) in a plane laid out for the same SIMD lanes:
 *
 *   nibbles u8[8 groups][16 ch][4 k]   lo nibble = channel c, hi = channel c + 16      512 B
 *   Q5 high u8[4 group pairs][8 ch][4 k], bit (o + 4 * (g & 1)) for octet o = c / 8   128 B
 *   Q6 high u8[8 groups][8 ch][4 k], bits (2o, 2o + 1)                                256 B
 *
 *   Q5_0: unit = 1 block,  header d[32] f16                                     704 B / 1024 w
 *   Q4_K: unit = 8 blocks, header d[32] dmin[32] f16, sc[8][32] m[8][32] u8     4736 B / 8192 w
 *   Q5_K: as Q4_K with Q5 high planes                                           5760 B / 8192 w
 *   Q6_K: unit = 8 blocks, header d[32] f16, sc[16][32] i8                      6720 B / 8192 w
 * so a panel streams about as many bytes as the file holds (Q6_K exactly as many).
 *
 * Weights: Q5_0 d (q - 16); Q4_K/Q5_K d sc_j q - dmin m_j per 32-k block j; Q6_K d sc_s (q - 32)
 * per 16-k half s. Activations are quant.c's: int8 per row and 32-block (d_x = amax / 127), with
 * their sums. Per work item (a panel, up to MC rows) each block is decoded once into unsigned
 * codes in L1 and then multiplied by every row (the batch reuses each weight block), MR rows at a
 * time; each row's float accumulation runs in one fixed order, so no row depends on M or on the
 * other rows. Code paths: AVX-512 VNNI, AVX2 with 256-bit VNNI, AVX2 (their integer dots in
 * kquant_dots.h), and portable C, chosen by the build flags; the SIMD paths give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kquant.h"
#include "pool.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MC 64
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_AVX2 1
/* vpdpbusd on 256-bit vectors: AVX-VNNI, or AVX512-VNNI with VL (which also brings 32 registers). */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define KQ_VNNI 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KQ_VNNI512 1   /* and 512-bit vpdpbusd over a decoded block's rows */
#endif
#endif
#endif

/* Rows per pass over a decoded block: as many as the dot accumulators leave registers for. */
#if defined(KQ_VNNI512)
#define MR 6
#define FORMAT_MR(F) (F == FMT_Q6_K ? 4 : 6)
#elif defined(KQ_VNNI) && defined(__AVX512VL__)
#define MR 4
#define FORMAT_MR(F) (F == FMT_Q6_K ? 3 : 4)
#else
#define MR 3
#define FORMAT_MR(F) (F == FMT_Q4_K ? 3 : 2)   /* AVX2: Q4_K sums all 8 groups in int16, the others need more */
#endif

/* quant.c: the legacy formats' tiles over activations quantized here. */
void quant_panel_rows(int fmt, const uint8_t *wp, int64_t KB, const int8_t *qx, int64_t K, const float *dx,
                      const int32_t *sx, const float *sxd, const float *bias, float *y, int64_t ldy, int64_t nc,
                      int64_t m0, int64_t m1);

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------ activations */

typedef struct {
    int8_t *qx;        /* [M][K] */
    float *dx, *sxd;   /* [M][KB]: scale, scale * sum */
    int32_t *sx, *s16; /* [M][KB]: sum; the two 16-k half sums as int16 (lo | hi << 16) */
} acts;

/* One row: per 32-block scale d = amax / 127, codes q = round-to-nearest-even(x * 127 / amax), the
 * block's sum and its two 16-halves' sums. The AVX2 path gives the same bits as the scalar one. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, int32_t *s, float *sd, int32_t *s16) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        int32_t half[2] = {0, 0};
        float amax = 0.f;
#if defined(KQ_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        amax = _mm_cvtss_f32(m4);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i c[4];
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        for (int h = 0; h < 2; h++) {
            __m256i t = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
            half[h] = _mm_cvtsi128_si32(t4);
        }
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back. */
        const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        _mm256_storeu_si256((__m256i *)(q + b * QK),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < QK; i++) {
            const int32_t v = (int32_t)nearbyintf(xb[i] * inv);
            q[b * QK + i] = (int8_t)v;
            half[i / 16] += v;
        }
#endif
        d[b] = amax / 127.f;
        s[b] = half[0] + half[1];
        sd[b] = d[b] * (float)s[b];
        s16[b] = (int32_t)(((uint32_t)half[0] & 0xffff) | ((uint32_t)half[1] << 16));
    }
}

/* The rows of x as the matmul quantizes them (for tests and references): q (M, K), d (M, K/32). */
int quant_activations(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *q, float *d) {
    if (K % QK) return -1;
    int32_t *s = malloc(sizeof(int32_t) * (K / QK) * 2);
    float *sd = malloc(sizeof(float) * (K / QK));
    if (!s || !sd) { free(s); free(sd); return -2; }
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, K, q + m * K, d + m * (K / QK), s, sd, s + K / QK);
    free(s);
    free(sd);
    return 0;
}

/* ------------------------------------------------------------------ one block decoded, then the rows */

typedef struct {
    uint8_t codes[8][4][32];   /* [group][octet][8 ch x 4 k]: unsigned codes */
    float dmul[NR], mmul[NR];  /* per channel: the scale of an integer dot, the min (K4/K5) */
    int32_t sc16[2][NR];       /* Q6_K: the two halves' scales as int16 pairs (s, s) */
    int32_t scab[NR];          /* Q6_K: (scale of half 0, scale of half 1) */
} block_t;

#if defined(KQ_AVX2)
/* The unsigned codes of group g (4 k) of a block for the four octets of 8 channels. */
static inline __attribute__((always_inline)) void group_codes(const int fmt, const uint8_t *nib, const uint8_t *high,
                                                              int g, __m256i c[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(nib + g * 64));
    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(nib + g * 64 + 32));
    c[0] = _mm256_and_si256(v0, low4);
    c[1] = _mm256_and_si256(v1, low4);
    c[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
    c[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
    if (fmt == FMT_Q6_K) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(high + g * 32)), m = _mm256_set1_epi8(0x30);
        c[0] = _mm256_or_si256(c[0], _mm256_and_si256(_mm256_slli_epi16(u, 4), m));
        c[1] = _mm256_or_si256(c[1], _mm256_and_si256(_mm256_slli_epi16(u, 2), m));
        c[2] = _mm256_or_si256(c[2], _mm256_and_si256(u, m));
        c[3] = _mm256_or_si256(c[3], _mm256_and_si256(_mm256_srli_epi16(u, 2), m));
    } else if (fmt != FMT_Q4_K) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(high + (g / 2) * 32)), m = _mm256_set1_epi8(0x10);
        if (g & 1) {   /* bits 4..7 -> bit 4 */
            c[0] = _mm256_or_si256(c[0], _mm256_and_si256(u, m));
            c[1] = _mm256_or_si256(c[1], _mm256_and_si256(_mm256_srli_epi16(u, 1), m));
            c[2] = _mm256_or_si256(c[2], _mm256_and_si256(_mm256_srli_epi16(u, 2), m));
            c[3] = _mm256_or_si256(c[3], _mm256_and_si256(_mm256_srli_epi16(u, 3), m));
        } else {       /* bits 0..3 -> bit 4 */
            c[0] = _mm256_or_si256(c[0], _mm256_and_si256(_mm256_slli_epi16(u, 4), m));
            c[1] = _mm256_or_si256(c[1], _mm256_and_si256(_mm256_slli_epi16(u, 3), m));
            c[2] = _mm256_or_si256(c[2], _mm256_and_si256(_mm256_slli_epi16(u, 2), m));
            c[3] = _mm256_or_si256(c[3], _mm256_and_si256(_mm256_slli_epi16(u, 1), m));
        }
    }
}

/* Octet o's per-channel float scale (and min, K4/K5) of block kb of a unit; Q6_K: its int16 scale pairs. */
static inline __attribute__((always_inline)) void octet_scales(const int fmt, const uint8_t *unit, int64_t kb, int o,
                                                               __m256 *dmul, __m256 *mmul, __m256i *sc0,
                                                               __m256i *sc1, __m256i *scab) {
    const __m256i low16 = _mm256_set1_epi32(0xffff);
    *dmul = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + o * 16)));
    if (fmt == FMT_Q6_K) {
        const uint8_t *sc = unit + 64 + 2 * kb * 32 + o * 8;
        const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 32)));
        *sc0 = _mm256_or_si256(_mm256_and_si256(a, low16), _mm256_slli_epi32(a, 16));
        *sc1 = _mm256_or_si256(_mm256_and_si256(b, low16), _mm256_slli_epi32(b, 16));
        *scab = _mm256_or_si256(_mm256_and_si256(a, low16), _mm256_slli_epi32(b, 16));
    } else if (fmt != FMT_Q5_0) {
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 64 + o * 16)));
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(unit + 128 + kb * 32 + o * 8)));
        const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(unit + 384 + kb * 32 + o * 8)));
        *dmul = _mm256_mul_ps(*dmul, _mm256_cvtepi32_ps(sc));
        *mmul = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(m));
    }
}

/* One block's step for 8 channels of one row: a + its integer dots dt, with the zero point / Q6_K
 * offset taken off in int32 (x = the row's block values), then one fixed float sequence per channel.
 * Every integer path (maddubs, dpbusd) ends here, so all give the same bits. */
static inline __attribute__((always_inline)) __m256 octet_step(const int fmt, __m256i dt, __m256 a, __m256 dmul,
                                                               __m256 mmul, __m256i scab, float dx, int32_t sx,
                                                               float sxd, int32_t s16) {
    if (fmt == FMT_Q5_0) dt = _mm256_sub_epi32(dt, _mm256_set1_epi32(16 * sx));
    if (fmt == FMT_Q6_K)
        dt = _mm256_sub_epi32(dt, _mm256_slli_epi32(_mm256_madd_epi16(scab, _mm256_set1_epi32(s16)), 5));
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dt), _mm256_mul_ps(dmul, _mm256_set1_ps(dx)), a);
    if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) a = _mm256_fnmadd_ps(mmul, _mm256_set1_ps(sxd), a);
    return a;
}

/* The same for block_rows' layout: acc[r][0..32) of rows r < mr from dot[r][octet]. */
#define ROWS_STEP(fmt, mr, blk, dot, acc, dx, sx, sxd, s16, KB)                                                     \
    for (int r = 0; r < (mr); r++)                                                                              \
        for (int o = 0; o < 4; o++) {                                                                           \
            const int64_t i_ = r * (KB);                                                                        \
            const __m256 a_ = octet_step(fmt, dot[r][o], _mm256_loadu_ps(acc[r] + o * 8),                       \
                                         _mm256_loadu_ps((blk)->dmul + o * 8), _mm256_loadu_ps((blk)->mmul + o * 8), \
                                         _mm256_loadu_si256((const __m256i *)((blk)->scab + o * 8)), dx[i_],    \
                                         sx[i_], sxd[i_], s16[i_]);                                             \
            _mm256_storeu_ps(acc[r] + o * 8, a_);                                                               \
        }
#endif

#if defined(KQ_AVX2)
#include "kquant_dots.h"   /* rows_dots, one_row_dots: a block's integer dots, per instruction set */
#endif

/* Unit header + block kb within it -> block_t. */
static void decode_block(int fmt, const uint8_t *unit, int64_t kb, block_t *blk) {
    const uint8_t *nib = unit + header_bytes(fmt) + kb * body_bytes(fmt), *high = nib + 512;
#if defined(KQ_AVX2)
    /* The panel streams from memory: ask for the bytes a few blocks ahead (a panel is contiguous). */
    for (int64_t i = 0; i < body_bytes(fmt); i += 64) _mm_prefetch((const char *)nib + PREFETCH_BYTES + i, _MM_HINT_T0);
    for (int g = 0; g < 8; g++) {
        __m256i c[4];
        group_codes(fmt, nib, high, g, c);
        for (int o = 0; o < 4; o++) _mm256_storeu_si256((__m256i *)blk->codes[g][o], c[o]);
    }
    for (int o = 0; o < 4; o++) {
        __m256 dmul, mmul = _mm256_setzero_ps();
        __m256i sc0 = _mm256_setzero_si256(), sc1 = sc0, scab = sc0;
        octet_scales(fmt, unit, kb, o, &dmul, &mmul, &sc0, &sc1, &scab);
        _mm256_storeu_ps(blk->dmul + o * 8, dmul);
        _mm256_storeu_ps(blk->mmul + o * 8, mmul);
        _mm256_storeu_si256((__m256i *)(blk->sc16[0] + o * 8), sc0);
        _mm256_storeu_si256((__m256i *)(blk->sc16[1] + o * 8), sc1);
        _mm256_storeu_si256((__m256i *)(blk->scab + o * 8), scab);
    }
#else
    for (int g = 0; g < 8; g++)
        for (int o = 0; o < 4; o++)
            for (int p = 0; p < 32; p++) {
                const uint8_t v = nib[g * 64 + (o & 1) * 32 + p];
                int q = o < 2 ? v & 15 : v >> 4;
                if (fmt == FMT_Q6_K) q |= ((high[g * 32 + p] >> (2 * o)) & 3) << 4;
                else if (fmt != FMT_Q4_K) q |= ((high[(g / 2) * 32 + p] >> (o + 4 * (g & 1))) & 1) << 4;
                blk->codes[g][o][p] = (uint8_t)q;
            }
    const uint16_t *d = (const uint16_t *)unit;
    for (int c = 0; c < NR; c++) {
        const float dc = kq_half_to_float(d[c]);
        if (fmt == FMT_Q5_0) blk->dmul[c] = dc;
        else if (fmt == FMT_Q6_K) {
            const int8_t *sc = (const int8_t *)(unit + 64);
            const int32_t a = sc[(2 * kb) * 32 + c], b = sc[(2 * kb + 1) * 32 + c];
            blk->dmul[c] = dc;
            blk->sc16[0][c] = (int32_t)(((uint32_t)a & 0xffff) | ((uint32_t)a << 16));
            blk->sc16[1][c] = (int32_t)(((uint32_t)b & 0xffff) | ((uint32_t)b << 16));
            blk->scab[c] = (int32_t)(((uint32_t)a & 0xffff) | ((uint32_t)b << 16));
        } else {
            const uint16_t *dmin = (const uint16_t *)(unit + 64);
            blk->dmul[c] = dc * (float)unit[128 + kb * 32 + c];
            blk->mmul[c] = kq_half_to_float(dmin[c]) * (float)unit[384 + kb * 32 + c];
        }
    }
#endif
}

/* acc[r][0..32) += this block's contribution for rows r < mr (row r's activations at offset r). */
static inline __attribute__((always_inline)) void block_rows(const int fmt, const int mr, const block_t *blk,
                                                             const int8_t *qx, int64_t K, const float *dx,
                                                             const int32_t *sx, const float *sxd,
                                                             const int32_t *s16, int64_t KB, float (*acc)[NR]) {
#if defined(KQ_AVX2)
    __m256i dot[MR][4];
    rows_dots(fmt, mr, blk, qx, K, dot);
    ROWS_STEP(fmt, mr, blk, dot, acc, dx, sx, sxd, s16, KB)
#else
    for (int r = 0; r < mr; r++) {
        const int64_t i = r * KB;
        const int8_t *q = qx + r * K;
        const int16_t h0 = (int16_t)(s16[i] & 0xffff), h1 = (int16_t)((uint32_t)s16[i] >> 16);
        for (int c = 0; c < NR; c++) {
            const int o = c / 8, p = (c % 8) * 4;
            int32_t dot = 0;
            for (int g = 0; g < 8; g++) {
                int32_t part = 0;
                for (int k = 0; k < 4; k++) part += (int32_t)blk->codes[g][o][p + k] * q[g * 4 + k];
                dot += fmt == FMT_Q6_K ? part * (int16_t)(blk->sc16[g / 4][c] & 0xffff) : part;
            }
            if (fmt == FMT_Q5_0) dot -= 16 * sx[i];
            if (fmt == FMT_Q6_K) {
                const int32_t ab = blk->scab[c];
                dot -= 32 * ((int16_t)(ab & 0xffff) * h0 + (int16_t)((uint32_t)ab >> 16) * h1);
            }
            float a = acc[r][c] + (float)dot * (blk->dmul[c] * dx[i]);
            if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) a -= blk->mmul[c] * sxd[i];
            acc[r][c] = a;
        }
    }
#endif
}

#define FORMAT_ROWS(F)                                                                                           \
    for (int64_t r = m0; r < m1;) {                                                                             \
        const int64_t a = r * KB + kbg, left = m1 - r;                                                           \
        const int8_t *q = qx + r * K + kbg * QK;                                                                 \
        const int mr = (int)min64(FORMAT_MR(F), left);                                                           \
        if (MR >= 6 && mr == 6) block_rows(F, MR >= 6 ? 6 : 1, &blk, q, K, dx + a, sx + a, sxd + a, s16 + a, KB, acc + (r - m0)); \
        else if (MR >= 5 && mr == 5) block_rows(F, MR >= 5 ? 5 : 1, &blk, q, K, dx + a, sx + a, sxd + a, s16 + a, KB, acc + (r - m0)); \
        else if (MR >= 4 && mr == 4) block_rows(F, MR >= 4 ? 4 : 1, &blk, q, K, dx + a, sx + a, sxd + a, s16 + a, KB, acc + (r - m0)); \
        else if (mr == 3) block_rows(F, 3, &blk, q, K, dx + a, sx + a, sxd + a, s16 + a, KB, acc + (r - m0));         \
        else if (mr == 2) block_rows(F, 2, &blk, q, K, dx + a, sx + a, sxd + a, s16 + a, KB, acc + (r - m0));    \
        else block_rows(F, 1, &blk, q, K, dx + a, sx + a, sxd + a, s16 + a, KB, acc + (r - m0));                 \
        r += mr;                                                                                                 \
    }

#if defined(KQ_AVX2)
/* One row over a whole panel: each block's codes go from memory to the multiply in registers (a
 * decode step's matmuls have one row per request; with one request, nothing would reuse a copy). */
static inline __attribute__((always_inline)) void panel_one_row(const int fmt, const uint8_t *wp, int64_t K,
                                                                const acts *x, float *acc) {
    const int64_t blocks = unit_k(fmt) / QK, units = K / unit_k(fmt);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = wp + u * unit_bytes(fmt);
        for (int64_t kb = 0; kb < blocks; kb++) {
            const uint8_t *nib = unit + header_bytes(fmt) + kb * body_bytes(fmt), *high = nib + 512;
            for (int64_t i = 0; i < body_bytes(fmt); i += 64)
                _mm_prefetch((const char *)nib + PREFETCH_BYTES + i, _MM_HINT_T0);
            const int64_t kbg = u * blocks + kb;
            const int8_t *q = x->qx + kbg * QK;
            __m256 dmul[4], mmul[4];
            __m256i sc0[4], sc1[4], scab[4];
            for (int o = 0; o < 4; o++) {
                mmul[o] = _mm256_setzero_ps();
                sc0[o] = sc1[o] = scab[o] = _mm256_setzero_si256();
                octet_scales(fmt, unit, kb, o, &dmul[o], &mmul[o], &sc0[o], &sc1[o], &scab[o]);
            }
            __m256i dot[4];
            one_row_dots(fmt, nib, high, q, sc0, sc1, scab, dot);
            for (int o = 0; o < 4; o++)
                a[o] = octet_step(fmt, dot[o], a[o], dmul[o], mmul[o], scab[o], x->dx[kbg], x->sx[kbg], x->sxd[kbg],
                                  x->s16[kbg]);
        }
    }
    for (int o = 0; o < 4; o++) _mm256_storeu_ps(acc + o * 8, a[o]);
}
#endif

/* Rows m0..m1 (at most MC) of one panel of a K-quant / Q5_0 weight -> y columns [0, nc). */
static void kq_panel_rows(int fmt, const uint8_t *wp, int64_t K, const acts *x, const float *bias, float *y,
                          int64_t ldy, int64_t nc, int64_t m0, int64_t m1) {
    float acc[MC][NR];
    memset(acc, 0, sizeof(float) * NR * (size_t)(m1 - m0));
    const int64_t KB = K / QK, blocks = unit_k(fmt) / QK, units = K / unit_k(fmt);
    const int8_t *qx = x->qx;
    const float *dx = x->dx, *sxd = x->sxd;
    const int32_t *sx = x->sx, *s16 = x->s16;
#if defined(KQ_AVX2)
    if (m1 - m0 == 1) {
        switch (fmt) {
            case FMT_Q5_0: panel_one_row(FMT_Q5_0, wp, K, x, acc[0]); break;
            case FMT_Q4_K: panel_one_row(FMT_Q4_K, wp, K, x, acc[0]); break;
            case FMT_Q5_K: panel_one_row(FMT_Q5_K, wp, K, x, acc[0]); break;
            default: panel_one_row(FMT_Q6_K, wp, K, x, acc[0]); break;
        }
        for (int64_t c = 0; c < nc; c++) y[m0 * ldy + c] = acc[0][c] + (bias ? bias[c] : 0.f);
        return;
    }
#endif
    block_t blk;
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = wp + u * unit_bytes(fmt);
        for (int64_t kb = 0; kb < blocks; kb++) {
            const int64_t kbg = u * blocks + kb;
            decode_block(fmt, unit, kb, &blk);
            switch (fmt) {
                case FMT_Q5_0: FORMAT_ROWS(FMT_Q5_0); break;
                case FMT_Q4_K: FORMAT_ROWS(FMT_Q4_K); break;
                case FMT_Q5_K: FORMAT_ROWS(FMT_Q5_K); break;
                default: FORMAT_ROWS(FMT_Q6_K); break;
            }
        }
    }
    for (int64_t r = m0; r < m1; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + c] = acc[r - m0][c] + (bias ? bias[c] : 0.f);
}

/* ------------------------------------------------------------------ the linear layer */

typedef struct {
    int64_t fmt, n;           /* format code, output channels */
    const uint8_t *w;         /* repacked panels */
    const float *bias;        /* (n,) or NULL */
} kq_segment;

#define KQ_MAX_SEGMENTS 4
typedef struct {
    int64_t num_segments, k;
    kq_segment seg[KQ_MAX_SEGMENTS];
} kq_linear_t;

typedef struct {   /* kquant_k.c's activations: [M][K], [M][K/256], [M][K/32], [M][K/16] */
    int8_t *qx;
    float *du;
    int32_t *bs32, *o16;
} kacts;

typedef struct {
    const kq_linear_t *L;
    const float *x;
    int64_t ldx, ldy, M;
    float *y;
    acts a;
    kacts k;
    int has_k, has_other;
    int64_t first_item[KQ_MAX_SEGMENTS + 1], col[KQ_MAX_SEGMENTS], panels[KQ_MAX_SEGMENTS];
} linear_job;

static void quantize_item(void *arg, int64_t m) {
    const linear_job *j = arg;
    const int64_t K = j->L->k, KB = K / QK;
    if (j->has_other)
        quantize_row(j->x + m * j->ldx, K, j->a.qx + m * K, j->a.dx + m * KB, j->a.sx + m * KB, j->a.sxd + m * KB,
                     j->a.s16 + m * KB);
    if (j->has_k)
        kq_quantize_row_k(j->x + m * j->ldx, K, j->k.qx + m * K, j->k.du + m * (K / 256), j->k.bs32 + m * (K / 32),
                          j->k.o16 + m * (K / 16));
}

/* Items: per segment, (block of MC rows, panel), block-major. */
static void linear_item(void *arg, int64_t item) {
    const linear_job *j = arg;
    int s = 0;
    while (item >= j->first_item[s + 1]) s++;
    const kq_segment *seg = &j->L->seg[s];
    const int64_t local = item - j->first_item[s], panels = j->panels[s], K = j->L->k, KB = K / QK;
    const int64_t p = local % panels, m0 = (local / panels) * MC, m1 = min64(j->M, m0 + MC);
    const int64_t n0 = p * NR, nc = min64(NR, seg->n - n0);
    const float *bias = seg->bias ? seg->bias + n0 : 0;
    float *y = j->y + j->col[s] + n0;
    const int fmt = (int)seg->fmt;
    if (fmt < FMT_Q5_0) {
        const uint8_t *wp = seg->w + p * quant_panel_bytes(fmt, K);
        quant_panel_rows(fmt, wp, KB, j->a.qx + m0 * K, K, j->a.dx + m0 * KB, j->a.sx + m0 * KB,
                         j->a.sxd + m0 * KB, bias, y + m0 * j->ldy, j->ldy, nc, 0, m1 - m0);
    } else if (is_kquant(fmt)) {
        const uint8_t *wp = seg->w + p * (K / unit_k(fmt)) * unit_bytes(fmt);
        kq_panel_k(fmt, wp, K, j->k.qx + m0 * K, j->k.du + m0 * (K / 256), j->k.bs32 + m0 * (K / 32),
                   j->k.o16 + m0 * (K / 16), bias, y + m0 * j->ldy, j->ldy, nc, m1 - m0);
    } else {
        const uint8_t *wp = seg->w + p * (K / unit_k(fmt)) * unit_bytes(fmt);
        acts shifted = {j->a.qx + m0 * K, j->a.dx + m0 * KB, j->a.sxd + m0 * KB, j->a.sx + m0 * KB,
                        j->a.s16 + m0 * KB};
        kq_panel_rows(fmt, wp, K, &shifted, bias, y + m0 * j->ldy, j->ldy, nc, 0, m1 - m0);
    }
}

/* y[M, sum n] = x[M, K] . [W_0; W_1; ...]^T (+ biases): activations quantized once for every segment.
 * Returns 0, -1 for a format or K a segment cannot take, -2 when out of memory. */
int kq_linear(const float *x, int64_t ldx, const kq_linear_t *L, float *y, int64_t ldy, int64_t M,
              int64_t num_threads) {
    const int64_t K = L->k;
    if (K % QK || L->num_segments < 1 || L->num_segments > KQ_MAX_SEGMENTS) return -1;
    for (int64_t s = 0; s < L->num_segments; s++)
        if (L->seg[s].fmt < 0 || L->seg[s].fmt >= FMT_END || K % (L->seg[s].fmt < FMT_Q5_0 ? QK : unit_k((int)L->seg[s].fmt)))
            return -1;
    if (M <= 0) return 0;
    const int64_t KB = K / QK, blocks = (M + MC - 1) / MC;
    linear_job job = {L, x, ldx, ldy, M, y, {0}, {0}, 0, 0, {0}, {0}, {0}};
    for (int64_t s = 0; s < L->num_segments; s++) {
        if (is_kquant((int)L->seg[s].fmt)) job.has_k = 1;
        else job.has_other = 1;
    }
    const int64_t n_other = job.has_other ? M : 0, n_k = job.has_k ? M : 0;
    /* malloc(0) may return NULL: every buffer gets at least one byte */
    job.a.qx = malloc((size_t)(n_other * K) + 1);
    job.a.dx = malloc(sizeof(float) * n_other * KB + 1);
    job.a.sxd = malloc(sizeof(float) * n_other * KB + 1);
    job.a.sx = malloc(sizeof(int32_t) * n_other * KB + 1);
    job.a.s16 = malloc(sizeof(int32_t) * n_other * KB + 1);
    job.k.qx = malloc((size_t)(n_k * K) + 1);
    job.k.du = malloc(sizeof(float) * n_k * (K / 256) + 1);
    job.k.bs32 = malloc(sizeof(int32_t) * n_k * (K / 32) + 1);
    job.k.o16 = malloc(sizeof(int32_t) * n_k * (K / 16) + 1);
    if (!job.a.qx || !job.a.dx || !job.a.sxd || !job.a.sx || !job.a.s16 || !job.k.qx || !job.k.du || !job.k.bs32 ||
        !job.k.o16) {
        free(job.a.qx); free(job.a.dx); free(job.a.sxd); free(job.a.sx); free(job.a.s16);
        free(job.k.qx); free(job.k.du); free(job.k.bs32); free(job.k.o16);
        return -2;
    }
    int64_t col = 0;
    for (int64_t s = 0; s < L->num_segments; s++) {
        job.col[s] = col;
        col += L->seg[s].n;
        job.panels[s] = (L->seg[s].n + NR - 1) / NR;
        job.first_item[s + 1] = job.first_item[s] + job.panels[s] * blocks;
    }
    pool_for(M, quantize_item, &job, M * K < 16384 ? 1 : num_threads);   /* a few rows: not worth a thread */
    pool_for(job.first_item[L->num_segments], linear_item, &job, num_threads);
    free(job.a.qx); free(job.a.dx); free(job.a.sxd); free(job.a.sx); free(job.a.s16);
    free(job.k.qx); free(job.k.du); free(job.k.bs32); free(job.k.o16);
    return 0;
}

/* Which code path this build took for these formats: 0 portable, 1 AVX2, 2 AVX-512 VNNI (512-bit
 * over a decoded block's rows, 256-bit for one row), 3 AVX2 with 256-bit VNNI. */
int kq_isa(void) {
#if defined(KQ_VNNI512)
    return 2;
#elif defined(KQ_VNNI)
    return 3;
#elif defined(KQ_AVX2)
    return 1;
#else
    return 0;
#endif
}
