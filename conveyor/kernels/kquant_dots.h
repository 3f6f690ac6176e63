/* kquant.c's integer dots of one block (included by kquant.c, after block_t, group_codes and
 * octet_scales): rows_dots for a decoded block and a few rows, one_row_dots for one row straight from
 * the panel. dot[..][octet] holds 8 channels' int32 dots; Q6_K's include its per-16 scales.
 *
 * AVX2: maddubs into int16, madd to int32. VNNI: vpdpbusd multiplies the unsigned codes by the
 * int8 activations and adds each lane's 4 products straight into int32, one instruction for the
 * three, with no int16 stage to keep short against overflow. Both are exact (nothing can
 * overflow), and kquant.c's float step after them is shared, so every path gives the same bits.
 */
#ifndef CONVEYOR_KQUANT_DOTS_H
#define CONVEYOR_KQUANT_DOTS_H

#if !defined(KQ_VNNI)   /* ---------------------------------------------------------- AVX2 */
/* dot[r][octet] = the integer dots of one decoded block with rows r < mr (Q6_K: with its scales). */
static inline __attribute__((always_inline)) void rows_dots(const int fmt, const int mr, const block_t *blk,
                                                            const int8_t *qx, int64_t K, __m256i (*dot)[4]) {
    /* maddubs sums pairs into int16; several groups are summed there before widening (madd), as
     * many as cannot overflow with |x| <= 127: 2 * 15 * 127 * 8, 2 * 31 * 127 * 4, 2 * 63 * 127 * 2
     * all stay under 32767. Q6_K widens with its per-16 scales as the madd operand. */
    const int SPAN = fmt == FMT_Q4_K ? 8 : fmt == FMT_Q6_K ? 2 : 4;
    __m256i part[MR][4];
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < 4; o++) dot[r][o] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g0 = 0; g0 < 8; g0 += SPAN) {
        for (int g = g0; g < g0 + SPAN; g++) {
            __m256i xb[MR];
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, qx + r * K + g * 4, 4);
                xb[r] = _mm256_set1_epi32(four);
            }
            for (int o = 0; o < 4; o++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)blk->codes[g][o]);
                for (int r = 0; r < mr; r++) {
                    const __m256i p = _mm256_maddubs_epi16(w, xb[r]);
                    part[r][o] = g == g0 ? p : _mm256_add_epi16(part[r][o], p);
                }
            }
        }
        for (int o = 0; o < 4; o++) {
            const __m256i s = fmt == FMT_Q6_K ? _mm256_loadu_si256((const __m256i *)(blk->sc16[g0 / 4] + o * 8)) : ones;
            for (int r = 0; r < mr; r++) dot[r][o] = _mm256_add_epi32(dot[r][o], _mm256_madd_epi16(part[r][o], s));
        }
    }
}

/* dot[octet] = the integer dots of one block, decoded from the panel in registers, with one row q
 * (Q6_K: with the halves' scales sc0, sc1). */
static inline __attribute__((always_inline)) void one_row_dots(const int fmt, const uint8_t *nib, const uint8_t *high,
                                                               const int8_t *q, const __m256i sc0[4],
                                                               const __m256i sc1[4], const __m256i scab[4],
                                                               __m256i dot[4]) {
    (void)scab;
    const int SPAN = fmt == FMT_Q4_K ? 8 : fmt == FMT_Q6_K ? 2 : 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int o = 0; o < 4; o++) dot[o] = _mm256_setzero_si256();
    for (int g0 = 0; g0 < 8; g0 += SPAN) {
        __m256i part[4];
        for (int g = g0; g < g0 + SPAN; g++) {
            __m256i c[4];
            group_codes(fmt, nib, high, g, c);
            int32_t four;
            memcpy(&four, q + g * 4, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            for (int o = 0; o < 4; o++) {
                const __m256i p = _mm256_maddubs_epi16(c[o], xb);
                part[o] = g == g0 ? p : _mm256_add_epi16(part[o], p);
            }
        }
        for (int o = 0; o < 4; o++) {
            const __m256i s = fmt == FMT_Q6_K ? (g0 < 4 ? sc0[o] : sc1[o]) : ones;
            dot[o] = _mm256_add_epi32(dot[o], _mm256_madd_epi16(part[o], s));
        }
    }
}
#else   /* ------------------------------------------------------------------------- VNNI */

static inline __attribute__((always_inline)) __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u8, s8);
#else
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}

/* Q6_K: sa * h0 + sb * h1 for the two 16-k halves' dots, with scab = (sa, sb) as int16 pairs. */
static inline __attribute__((always_inline)) __m256i q6_halves(__m256i h0, __m256i h1, __m256i scab) {
    const __m256i sa = _mm256_srai_epi32(_mm256_slli_epi32(scab, 16), 16), sb = _mm256_srai_epi32(scab, 16);
    return _mm256_add_epi32(_mm256_mullo_epi32(h0, sa), _mm256_mullo_epi32(h1, sb));
}

#if defined(KQ_VNNI512)
/* dot[r][octet] = the integer dots of one decoded block with rows r < mr (Q6_K: with its scales).
 * Each 512-bit vector holds two octets, so a loaded code vector and a broadcast serve twice as many
 * channels; the dots are split back into octets for octet_step. */
static inline __attribute__((always_inline)) void rows_dots(const int fmt, const int mr, const block_t *blk,
                                                            const int8_t *qx, int64_t K, __m256i (*dot)[4]) {
    __m512i d[MR][2], h0[MR][2];
    for (int r = 0; r < mr; r++) d[r][0] = d[r][1] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
        if (fmt == FMT_Q6_K && g == 4)
            for (int r = 0; r < mr; r++)
                for (int o = 0; o < 2; o++) {
                    h0[r][o] = d[r][o];
                    d[r][o] = _mm512_setzero_si512();
                }
        const __m512i w0 = _mm512_loadu_si512(blk->codes[g][0]), w1 = _mm512_loadu_si512(blk->codes[g][2]);
        for (int r = 0; r < mr; r++) {
            int32_t four;
            memcpy(&four, qx + r * K + g * 4, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            d[r][0] = _mm512_dpbusd_epi32(d[r][0], w0, xb);
            d[r][1] = _mm512_dpbusd_epi32(d[r][1], w1, xb);
        }
    }
    if (fmt == FMT_Q6_K)
        for (int o = 0; o < 2; o++) {
            const __m512i ab = _mm512_loadu_si512(blk->scab + o * 16);
            const __m512i sa = _mm512_srai_epi32(_mm512_slli_epi32(ab, 16), 16), sb = _mm512_srai_epi32(ab, 16);
            for (int r = 0; r < mr; r++)
                d[r][o] = _mm512_add_epi32(_mm512_mullo_epi32(h0[r][o], sa), _mm512_mullo_epi32(d[r][o], sb));
        }
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < 2; o++) {
            dot[r][2 * o] = _mm512_castsi512_si256(d[r][o]);
            dot[r][2 * o + 1] = _mm512_extracti64x4_epi64(d[r][o], 1);
        }
}
#else
/* dot[r][octet] = the integer dots of one decoded block with rows r < mr (Q6_K: with its scales). */
static inline __attribute__((always_inline)) void rows_dots(const int fmt, const int mr, const block_t *blk,
                                                            const int8_t *qx, int64_t K, __m256i (*dot)[4]) {
    __m256i h0[MR][4];   /* Q6_K: the first half's dots, scaled at the end */
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < 4; o++) dot[r][o] = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        if (fmt == FMT_Q6_K && g == 4)
            for (int r = 0; r < mr; r++)
                for (int o = 0; o < 4; o++) {
                    h0[r][o] = dot[r][o];
                    dot[r][o] = _mm256_setzero_si256();
                }
        __m256i xb[MR];
        for (int r = 0; r < mr; r++) {
            int32_t four;
            memcpy(&four, qx + r * K + g * 4, 4);
            xb[r] = _mm256_set1_epi32(four);
        }
        for (int o = 0; o < 4; o++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)blk->codes[g][o]);
            for (int r = 0; r < mr; r++) dot[r][o] = dpbusd(dot[r][o], w, xb[r]);
        }
    }
    if (fmt == FMT_Q6_K)
        for (int o = 0; o < 4; o++) {
            const __m256i ab = _mm256_loadu_si256((const __m256i *)(blk->scab + o * 8));
            for (int r = 0; r < mr; r++) dot[r][o] = q6_halves(h0[r][o], dot[r][o], ab);
        }
}
#endif

/* dot[octet] = the integer dots of one block, decoded from the panel in registers, with one row q
 * (Q6_K: with the halves' scales in scab). */
static inline __attribute__((always_inline)) void one_row_dots(const int fmt, const uint8_t *nib, const uint8_t *high,
                                                               const int8_t *q, const __m256i sc0[4],
                                                               const __m256i sc1[4], const __m256i scab[4],
                                                               __m256i dot[4]) {
    (void)sc0, (void)sc1;
    __m256i h0[4];
    for (int o = 0; o < 4; o++) dot[o] = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        if (fmt == FMT_Q6_K && g == 4)
            for (int o = 0; o < 4; o++) {
                h0[o] = dot[o];
                dot[o] = _mm256_setzero_si256();
            }
        __m256i c[4];
        group_codes(fmt, nib, high, g, c);
        int32_t four;
        memcpy(&four, q + g * 4, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        for (int o = 0; o < 4; o++) dot[o] = dpbusd(dot[o], c[o], xb);
    }
    if (fmt == FMT_Q6_K)
        for (int o = 0; o < 4; o++) dot[o] = q6_halves(h0[o], dot[o], scab[o]);
}

#endif
#endif
