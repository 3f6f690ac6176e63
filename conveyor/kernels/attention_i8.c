/* The integer side of attention.c over the 8-bit KV cache: a chunk of 16 keys' scores for a tile's
 * query heads as integer dot products, written once over kq_vec.h's 16 lanes (one lane a key).
 *
 * Each query head is quantized once per call to int16 in blocks of 16 d (a head's few outlier d
 * coarsen only their own block): d_q = absmax / 32767, codes round-to-nearest-even(x / d_q) (8-bit
 * queries, as the keys, cost too much greedy agreement with the float16 cache: 10 of 20 prompts' first
 * 16 tokens against 13 of 20). A chunk's key codes are widened to int16 and paired, two consecutive d
 * in one 32-bit lane (vpdpwssd's operand); then, block after block in order (a fused multiply-add),
 *
 *   score = sum_b float(sum_(d in b) k q) * (d_qb * (d_k * softmax scale))
 *
 * The integer sum is exact on every path (AVX-512 VNNI, 256-bit VNNI, AVX2 madd, portable C) and
 * the two float multiplies are the same IEEE operations on each, so a score has the same bits
 * whatever the instruction set, the tile or the other rows of the step.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "kq_vec.h"

#if KN_ISA == KN_ISA_AVX512_VNNI
#define SR 8   /* query heads per pass over the chunk's keys: each loaded key vector serves all of them */
#else
#define SR 4
#endif
_Static_assert(ATTN_I8_QPAD % SR == 0, "the padded query heads cover whole passes");

void attn_i8_query(const float *x, int64_t D, int16_t *codes, float *d) {
    for (int64_t b = 0; b < D / 16; b++) {
        float amax = 0.f;
        for (int64_t i = 16 * b; i < 16 * b + 16; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float s = amax / 32767.f;
        for (int64_t i = 16 * b; i < 16 * b + 16; i++)
            codes[i] = (int16_t)(s > 0.f ? (int32_t)nearbyintf(x[i] / s) : 0);
        d[b] = s;
    }
}

/* dst[64]: lane t = the int16 pair (src[t], src[stride + t]): 2 rows of 16 codes as 16 lanes. */
static inline void pair2x16(const int8_t *src, int64_t stride, uint8_t *dst) {
#if defined(__SSE4_1__) || defined(__AVX2__)
    const __m128i r0 = _mm_loadu_si128((const __m128i *)src), r1 = _mm_loadu_si128((const __m128i *)(src + stride));
    const __m128i lo = _mm_unpacklo_epi8(r0, r1), hi = _mm_unpackhi_epi8(r0, r1);
#if KN_AVX512
    _mm512_storeu_si512(dst, _mm512_cvtepi8_epi16(_mm256_set_m128i(hi, lo)));
#else
    _mm_storeu_si128((__m128i *)dst, _mm_cvtepi8_epi16(lo));
    _mm_storeu_si128((__m128i *)(dst + 16), _mm_cvtepi8_epi16(_mm_srli_si128(lo, 8)));
    _mm_storeu_si128((__m128i *)(dst + 32), _mm_cvtepi8_epi16(hi));
    _mm_storeu_si128((__m128i *)(dst + 48), _mm_cvtepi8_epi16(_mm_srli_si128(hi, 8)));
#endif
#else
    int16_t out[32];
    for (int t = 0; t < 16; t++) out[2 * t] = src[t], out[2 * t + 1] = src[stride + t];
    memcpy(dst, out, sizeof out);
#endif
}

void attn_i8_keys(const int8_t *codes, int64_t bs, int64_t n_keys, int64_t D, uint8_t *kt) {
    if (n_keys == 16) {
        for (int64_t g = 0; g < D / 2; g++) pair2x16(codes + 2 * g * bs, bs, kt + 64 * g);
        return;
    }
    int16_t *out = (int16_t *)kt;   /* a partial chunk: the keys past n_keys are codes 0 */
    for (int64_t g = 0; g < D / 2; g++)
        for (int t = 0; t < 16; t++)
            for (int i = 0; i < 2; i++) out[32 * g + 2 * t + i] = t < n_keys ? codes[(2 * g + i) * bs + t] : 0;
}

void attn_i8_scores(const uint8_t *kt, int64_t D, const int16_t *qc, int64_t ldqc, const float *qd, int64_t ldqd,
                    int64_t A, const float *kscale, float *p) {
    const v16f ks = vfload(kscale);
    for (int64_t a0 = 0; a0 < A; a0 += SR) {
        const int64_t nr = A - a0 < SR ? A - a0 : SR;
        v16f sum[SR];
        for (int64_t b = 0; b < D / 16; b++) {
            v16i acc[SR];
#pragma GCC unroll 8
            for (int r = 0; r < SR; r++) acc[r] = vzero();
            for (int64_t g = 8 * b; g < 8 * b + 8; g++) {
                const v16i k = vload(kt + 64 * g);
#pragma GCC unroll 8
                for (int r = 0; r < SR; r++) acc[r] = vdot16(acc[r], k, load_i32(qc + (a0 + r) * ldqc + 2 * g));
            }
#pragma GCC unroll 8
            for (int r = 0; r < SR; r++) {
                const v16f f = vfmul(vfset(r < nr ? qd[(a0 + r) * ldqd + b] : 0.f), ks);
                sum[r] = b == 0 ? vfmul(vcvt(acc[r]), f) : vfma(vcvt(acc[r]), f, sum[r]);
            }
        }
        for (int r = 0; r < nr; r++) vfstore(p + (a0 + r) * 16, sum[r]);
    }
}
