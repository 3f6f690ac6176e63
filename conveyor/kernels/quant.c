/* Matmul on weights kept quantized in blocks of 32 along K: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * Weights are repacked at load (kquant_repack.c) into panels of NR = 32 output channels; a panel is a
 * run of K/32 blocks (kn_panel_q8_0, _q4_0, _q4_1 in kernels.h), each block holding unsigned codes,
 * then fp16 scales d (and fp16 mins m):
 *   Q8   : codes u8[8 groups][32 ch][4 k]                 1024 B, d[32]          -> 1088 B / 1024 w
 *   Q4_0 : nibbles u8[8 groups][16 ch][4 k] (lo = ch c,   512 B, d[32]          ->  576 B
 *          hi = ch c + 16)
 *   Q4_1 : as Q4_0, then m[32]                                                  ->  640 B
 * A weight is d * (code - zp) (+ m for Q4_1), zp = 128 (Q8), 8 (Q4_0), 0 (Q4_1). Four consecutive
 * k per channel sit in one 32-bit lane, the operand layout of vpdpbusd (u8 x s8 -> s32): one
 * vector of codes times a broadcast of 4 activation bytes gives 16 channels' partial dots at once.
 *
 * Activations are quantized per row and per 32-block to int8 (d_x = amax / 127), as llama.cpp's
 * Q8 activations, by kquant.c's linear layer, which runs these tiles as its segments. Per block the
 * integer dot is exact, and the float step
 *   acc += float(isum - zp * sum(q_x)) * (d_w * d_x)   (+ m_w * (d_x * sum(q_x)))
 * runs in one fixed order per row, so a row's output never depends on M or on the other rows.
 * Code paths: AVX-512 VNNI, AVX2 with 256-bit VNNI, AVX2 (maddubs/madd), portable C: kernels.h's
 * tiers for the build flags. All integer dots are exact and the float steps the same, so the SIMD paths agree bit
 * for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MC 64   /* rows per work item: their quantized activations stay in cache while panels stream */

#if KN_VNNI512
#define HAVE_VNNI512 1
#define MR 6    /* rows per pass over a panel: each loaded weight vector serves all of them */
#elif KN_AVX2
#define HAVE_AVX2 1
#define MR 4
#if KN_VNNI256   /* 256-bit vpdpbusd in the AVX2 tile */
#define HAVE_VNNI256 1
#endif
#else
#define MR 4
#endif

#define INLINE static inline __attribute__((always_inline))

/* How far ahead a streamed Q8_0 panel's lines are asked for (quant_panel_rows' `stream`). Zen 4, two
 * threads, one row, the 0.5B file's 145 MB output layer, old and new alternated in one process: no
 * prefetch 27-31 GB/s, 2 KiB +11 %, 3-4 KiB +13-16 %, 8 KiB +6 %. A Q8_0 layer that a last-level cache
 * holds (the bundled model's output) is 10-15 % slower with it, the bundled model's Q4_1 layers 2-8 %. */
#define STREAM_AHEAD 3072

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Opaque to gcc (noipa), as a call into another file would be: seen through, it lets gcc vectorise the
 * portable tile and reassociate its float steps, which changes their bits. */
static __attribute__((noipa)) float half_to_float(uint16_t h) { return f16_to_f32(h); }

/* ------------------------------------------------------------------ tiles: mr rows x one panel */

#if defined(HAVE_VNNI512)
INLINE void tile(const int fmt, const int mr, const uint8_t *w, int64_t KB, const int8_t *qx, int64_t K,
                 const float *dx, const int32_t *sx, const float *sxd, const float *bias, float *y,
                 int64_t ldy, int64_t nc, const int stream) {
    __m512 acc[MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint8_t *blk = w + kb * block_bytes(fmt);
        const uint8_t *sc = blk + code_bytes(fmt);
        if (stream)   /* the block's lines STREAM_AHEAD bytes on, into L2 */
            for (int64_t i = 0; i < block_bytes(fmt); i += 64) __builtin_prefetch(blk + STREAM_AHEAD + i, 0, 1);
        __m512i dot[MR][2];
        for (int r = 0; r < mr; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m512i w0, w1;
            if (fmt == FMT_Q8_0) {
                w0 = _mm512_loadu_si512(blk + g * 128);
                w1 = _mm512_loadu_si512(blk + g * 128 + 64);
            } else {
                const __m512i v = _mm512_loadu_si512(blk + g * 64);
                w0 = _mm512_and_si512(v, low4);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, qx + r * K + kb * QK + g * 4, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
                dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
            }
        }
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        for (int r = 0; r < mr; r++) {
            const int64_t i = r * KB + kb;
            if (fmt != FMT_Q4_1) {
                const __m512i zs = _mm512_set1_epi32(zero_point(fmt) * sx[i]);
                dot[r][0] = _mm512_sub_epi32(dot[r][0], zs);
                dot[r][1] = _mm512_sub_epi32(dot[r][1], zs);
            }
            const __m512 s = _mm512_set1_ps(dx[i]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(d0, s), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(d1, s), acc[r][1]);
        }
        if (fmt == FMT_Q4_1) {
            const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 64)));
            const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 96)));
            for (int r = 0; r < mr; r++) {
                const __m512 t = _mm512_set1_ps(sxd[r * KB + kb]);
                acc[r][0] = _mm512_fmadd_ps(m0, t, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(m1, t, acc[r][1]);
            }
        }
    }
    const __mmask16 k0 = nc >= 16 ? 0xffff : (__mmask16)((1u << nc) - 1);
    const __mmask16 k1 = nc >= 32 ? 0xffff : nc <= 16 ? 0 : (__mmask16)((1u << (nc - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) { b0 = _mm512_maskz_loadu_ps(k0, bias); b1 = _mm512_maskz_loadu_ps(k1, bias + 16); }
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, _mm512_add_ps(acc[r][0], b0));
        _mm512_mask_storeu_ps(y + r * ldy + 16, k1, _mm512_add_ps(acc[r][1], b1));
    }
}
#elif defined(HAVE_AVX2)
#if defined(HAVE_VNNI256)
#define VNNI256 1
INLINE __m256i vnni256(__m256i acc, __m256i u8, __m256i s8) {
#if KN_VNNI256_EVEX
    return _mm256_dpbusd_epi32(acc, u8, s8);
#else
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}
#else
#define VNNI256 0
#endif
/* 16 registers: the panel goes in two halves of 16 channels (two 8-lane vectors each). With VNNI,
 * one vpdpbusd replaces maddubs + madd + add and takes Q8's unsigned codes as they are. */
INLINE void tile(const int fmt, const int mr, const uint8_t *w, int64_t KB, const int8_t *qx, int64_t K,
                 const float *dx, const int32_t *sx, const float *sxd, const float *bias, float *y,
                 int64_t ldy, int64_t nc, const int stream) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    const __m256i ones = _mm256_set1_epi16(1);
    (void)flip, (void)ones, (void)stream;   /* prefetching measured on the AVX-512 tile only */
    for (int h = 0; h < 2; h++) {
        const int64_t cols = nc - h * 16;
        if (cols <= 0) break;
        __m256 acc[MR][2];
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t kb = 0; kb < KB; kb++) {
            const uint8_t *blk = w + kb * block_bytes(fmt);
            const uint8_t *sc = blk + code_bytes(fmt);
            __m256i dot[MR][2];
            for (int r = 0; r < mr; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                __m256i w0, w1;
                if (fmt == FMT_Q8_0) {
                    w0 = _mm256_loadu_si256((const __m256i *)(blk + g * 128 + h * 64));
                    w1 = _mm256_loadu_si256((const __m256i *)(blk + g * 128 + h * 64 + 32));
#if !defined(HAVE_VNNI256)   /* back to signed codes; |q| with the sign moved onto x keeps maddubs from saturating */
                    w0 = _mm256_xor_si256(w0, flip);
                    w1 = _mm256_xor_si256(w1, flip);
#endif
                } else {
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + g * 64));
                    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + g * 64 + 32));
                    w0 = _mm256_and_si256(h ? _mm256_srli_epi16(v0, 4) : v0, low4);
                    w1 = _mm256_and_si256(h ? _mm256_srli_epi16(v1, 4) : v1, low4);
                }
                for (int r = 0; r < mr; r++) {
                    int32_t four;
                    memcpy(&four, qx + r * K + kb * QK + g * 4, 4);
                    const __m256i xb = _mm256_set1_epi32(four);
#if defined(HAVE_VNNI256)
                    dot[r][0] = vnni256(dot[r][0], w0, xb);
                    dot[r][1] = vnni256(dot[r][1], w1, xb);
#else
                    __m256i p0, p1;
                    if (fmt == FMT_Q8_0) {
                        p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(xb, w0));
                        p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(xb, w1));
                    } else {
                        p0 = _mm256_maddubs_epi16(w0, xb);
                        p1 = _mm256_maddubs_epi16(w1, xb);
                    }
                    dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(p0, ones));
                    dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(p1, ones));
#endif
                }
            }
            const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + h * 32)));
            const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + h * 32 + 16)));
            for (int r = 0; r < mr; r++) {
                const int64_t i = r * KB + kb;
                if (fmt == FMT_Q4_0 || (VNNI256 && fmt == FMT_Q8_0)) {   /* maddubs took Q8's codes signed */
                    const __m256i zs = _mm256_set1_epi32(zero_point(fmt) * sx[i]);
                    dot[r][0] = _mm256_sub_epi32(dot[r][0], zs);
                    dot[r][1] = _mm256_sub_epi32(dot[r][1], zs);
                }
                const __m256 s = _mm256_set1_ps(dx[i]);
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(d0, s), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), _mm256_mul_ps(d1, s), acc[r][1]);
                if (fmt == FMT_Q4_1) {
                    const __m256 t = _mm256_set1_ps(sxd[i]);
                    acc[r][0] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 64 + h * 32))), t, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 80 + h * 32))), t, acc[r][1]);
                }
            }
        }
        for (int r = 0; r < mr; r++) {
            float out[16];
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
            float *yr = y + r * ldy + h * 16;
            for (int64_t j = 0; j < cols && j < 16; j++) yr[j] = out[j] + (bias ? bias[h * 16 + j] : 0.f);
        }
    }
}
#else
INLINE void tile(const int fmt, const int mr, const uint8_t *w, int64_t KB, const int8_t *qx, int64_t K,
                 const float *dx, const int32_t *sx, const float *sxd, const float *bias, float *y,
                 int64_t ldy, int64_t nc, const int stream) {
    float acc[MR][NR];
    memset(acc, 0, sizeof(acc));
    (void)stream;
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint8_t *blk = w + kb * block_bytes(fmt);
        const uint16_t *sc = (const uint16_t *)(blk + code_bytes(fmt));
        uint8_t codes[NR][QK];   /* [channel][k] */
        for (int g = 0; g < 8; g++)
            for (int c = 0; c < NR; c++)
                for (int i = 0; i < 4; i++) {
                    if (fmt == FMT_Q8_0) codes[c][g * 4 + i] = blk[g * 128 + c * 4 + i];
                    else {
                        const uint8_t v = blk[g * 64 + (c & 15) * 4 + i];
                        codes[c][g * 4 + i] = c < 16 ? v & 15 : v >> 4;
                    }
                }
        for (int r = 0; r < mr; r++) {
            const int8_t *q = qx + r * K + kb * QK;
            const int64_t i = r * KB + kb;
            for (int c = 0; c < NR; c++) {
                int32_t dot = 0;
                for (int k = 0; k < QK; k++) dot += (int32_t)codes[c][k] * q[k];
                dot -= zero_point(fmt) * sx[i];
                acc[r][c] += (float)dot * (half_to_float(sc[c]) * dx[i]);
                if (fmt == FMT_Q4_1) acc[r][c] += half_to_float(sc[NR + c]) * sxd[i];
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int64_t j = 0; j < nc; j++) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}
#endif

/* Constant (format, rows) pairs, so each tile's loops unroll and its accumulators stay in registers. */
#define ROWS(F, mr, ...)                                  \
    switch (mr) {                                         \
        case 1: tile(F, 1, __VA_ARGS__); break;           \
        case 2: tile(F, 2, __VA_ARGS__); break;           \
        case 3: tile(F, 3, __VA_ARGS__); break;           \
        case 4: tile(F, 4, __VA_ARGS__); break;           \
        case 5: tile(F, MR >= 5 ? 5 : 1, __VA_ARGS__); break; \
        default: tile(F, MR >= 6 ? 6 : 1, __VA_ARGS__); break; \
    }

/* Rows m0..m1 of one panel over activations quantized by the caller (row m's at qx + m * K, dx + m * KB):
 * kquant.c's linear layer runs these formats as segments beside its own. `stream`: the layer is too large
 * for a last-level cache, so a Q8_0 panel's blocks are prefetched ahead. */
void quant_panel_rows(int fmt, const uint8_t *wp, int64_t KB, const int8_t *qx, int64_t K, const float *dx,
                      const int32_t *sx, const float *sxd, const float *bias, float *y, int64_t ldy, int64_t nc,
                      int64_t m0, int64_t m1, int stream) {
    for (int64_t m = m0; m < m1; m += MR) {
        const int mr = (int)min64(MR, m1 - m);
        const int64_t a = m * KB;
        if (fmt == FMT_Q8_0 && stream) {
            ROWS(FMT_Q8_0, mr, wp, KB, qx + m * K, K, dx + a, sx + a, sxd + a, bias, y + m * ldy, ldy, nc, 1);
        } else if (fmt == FMT_Q8_0) { ROWS(FMT_Q8_0, mr, wp, KB, qx + m * K, K, dx + a, sx + a, sxd + a, bias, y + m * ldy, ldy, nc, 0); }
        else if (fmt == FMT_Q4_0) { ROWS(FMT_Q4_0, mr, wp, KB, qx + m * K, K, dx + a, sx + a, sxd + a, bias, y + m * ldy, ldy, nc, 0); }
        else { ROWS(FMT_Q4_1, mr, wp, KB, qx + m * K, K, dx + a, sx + a, sxd + a, bias, y + m * ldy, ldy, nc, 0); }
    }
}
