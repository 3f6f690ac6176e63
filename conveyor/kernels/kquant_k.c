/* Matmul on weights kept in Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q3_K, Q4_K, Q5_K and Q6_K, repacked into kquant_repack.c's panels of 32
 * output channels (kn_panel_* in kernels.h), written once over kq_vec.h's 16-lane values.
 *
 * The K-quants' activations are quantized as llama.cpp's Q8_K: one scale per row and 256-k unit
 * (du = amax / 127), int8 codes, and the codes' sums per 32 k (for Q4_K / Q5_K's mins) and per 16 k
 * (for Q6_K's and Q3_K's offsets, kept as 32 * sum); the 32-k formats' as quant.c's, per 32 k (their
 * unit). IQ4's codes are its table's values + 128.
 * Within a unit everything is integer and exact:
 *
 *   Q4_K / Q5_K   si = sum_j sc_j dot_j,  sm = sum_j m_j bsum_j     y += du (d si - dmin sm)
 *   Q6_K          si = sum_s sc_s (dot_s - 32 hsum_s)               y += (d du) si
 *   Q3_K          si = sum_s sc_s (dot_s - 4 hsum_s)                y += (d du) si
 *   IQ4_XS        si = sum_j sc_j (dot_j - 128 bsum_j)              y += (d du) si
 *   Q5_0, IQ4_NL  si = dot - z bsum (z = 16, 128)                   y += (d du) si
 *   Q5_1          si = dot                                          y += du (d si + m bsum)
 *
 * so a unit costs two float steps per channel, and the same float operations on every path and
 * for every batch size: a row's result never depends on the other rows or the instruction set.
 *
 * A decode step has one row per request: with up to ROWS rows, each group of codes goes from the
 * panel to the dot products in registers and the rows' sums stay in registers from the panel's first
 * unit to its last, so the step is one pass over the weights at streaming speed (up to DIRECT_ROWS,
 * one pass per ROWS rows; on AVX-512 kquant_sets.c's one pass but for Q4_K). With more rows a unit is
 * decoded once into L1 and each pass of ROWS rows reads it there.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kq_codes.h"
#include "kq_vec.h"

#if KN_ISA == KN_ISA_AVX512_VNNI
#define ROWS 4   /* 6 accumulators a row fit 32 registers four times */
#else
#define ROWS 1
#endif
#ifndef DIRECT_ROWS
#define DIRECT_ROWS (2 * ROWS)
#endif
/* How a pass over a panel from memory gets its lines ahead of the dot products. Up to TOUCH_ROWS rows
 * (one or two streams decoding), with no software prefetch: each unit's header and each block's lines
 * touched first, in ascending order (touch_lines), let the hardware prefetcher stream ahead on its own (Zen
 * 4, 7B shapes, in process against the prefetch: one row Q4_K 1.26x, Q6_K 1.21x, Q5_0 + Q6_K 1.13x; two rows
 * 1.12-1.17x; with both, the prefetch's rate). With more rows a line's dot products take longer and the
 * hardware prefetcher no longer keeps ahead (M = 8: 0.62x): the block's lines are asked for PREFETCH_BYTES
 * ahead, into L2 (locality 1), in order, one or two per group of codes (8 KiB: 4 KiB 0.81x, 16 KiB 0.96x). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES(fmt) 8192
#endif
#ifndef TOUCH_ROWS
#define TOUCH_ROWS 2
#endif
/* The touched passes as instances of their own where speed counts; in the portable and sanitizer builds one
 * instance chooses at run time (their compile time, as KQ_UNROLL_GROUPS's). */
#if KN_ISA != KN_ISA_PORTABLE && !defined(KN_SANITIZE)
#define KQ_TOUCH_INSTANCES 1
#else
#define KQ_TOUCH_INSTANCES 0
#endif

/* ------------------------------------------------------------------ activations */

/* One row, unit by unit: codes round-to-nearest-even(x * 127 / amax), the same bits however vectorised
 * (the AVX-512 path's conversion rounds to nearest even as nearbyintf does in the default mode). */
void kq_quantize_row_k(const float *x, int64_t K, int8_t *q, float *du, int32_t *bs32, int32_t *o16) {
    for (int64_t u = 0; u < K / 256; u++) {
        const float *xu = x + u * 256;
        int8_t *qu = q + u * 256;
        int32_t sums[16];
#if KN_AVX512
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xu + i)), m);
        const float amax = _mm512_reduce_max_ps(m);
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        for (int s = 0; s < 16; s++) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xu + 16 * s), inv));
            const __m128i b = _mm512_cvtepi32_epi8(c);   /* the sums of the bytes kept, as the scalar path */
            _mm_storeu_si128((__m128i *)(qu + 16 * s), b);
            sums[s] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(b));
        }
#else
        float amax = 0.f;
        for (int i = 0; i < 256; i++) {
            const float a = fabsf(xu[i]);
            if (a > amax) amax = a;   /* fmaxf's result (a NaN is passed over) without a libm call */
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < 256; i++) qu[i] = (int8_t)(int32_t)nearbyintf(xu[i] * inv);
        for (int s = 0; s < 16; s++) {
            sums[s] = 0;
            for (int i = 0; i < 16; i++) sums[s] += qu[s * 16 + i];
        }
#endif
        du[u] = amax / 127.f;
        for (int s = 0; s < 16; s++) o16[u * 16 + s] = 32 * sums[s];
        for (int s = 0; s < 8; s++) bs32[u * 8 + s] = sums[2 * s] + sums[2 * s + 1];
    }
}

/* The rows of x as the K-quant matmul quantizes them: q (M, K), du (M, K/256). */
int kq_activations_k(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *q, float *du) {
    if (K % 256) return -1;
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)(K / 16 + K / 32));
    if (!sums) return -2;
    for (int64_t m = 0; m < M; m++) kq_quantize_row_k(x + m * ldx, K, q + m * K, du + m * (K / 256), sums, sums + K / 32);
    free(sums);
    return 0;
}

/* ------------------------------------------------------------------ one unit, a few rows */

/* sum += a b, fused, in a register or in memory */
KQV void add_sum(v16f (*y)[2], float (*acc)[NR], int r, int h, v16f a, v16f b) {
    if (acc) vfstore(acc[r] + 16 * h, vfma(a, b, vfload(acc[r] + 16 * h)));
    else y[r][h] = vfma(a, b, y[r][h]);
}

/* Row r's sums (channels 0-15, 16-31) += unit's contribution for rows r < mr: in registers y[r], or
 * where acc is given, in acc[r] (read at the end: loaded early they would take registers the unit needs).
 * Codes come from the panel (decoded == NULL) or from decode_unit's copy. */
KQV void unit_rows(const int fmt, const int mr, const uint8_t *unit, const uint8_t *decoded, const row_unit *x,
                   v16f (*y)[2], float (*acc)[NR], const int64_t ahead) {
    v16i si[ROWS][2], sm[ROWS][2];
    for (int r = 0; r < mr; r++) si[r][0] = si[r][1] = sm[r][0] = sm[r][1] = vzero();
    if (!decoded && !ahead) touch_lines(unit, header_bytes(fmt));
    for (int j = 0; j < unit_blocks(fmt); j++) {
        const uint8_t *blk = unit + header_bytes(fmt) + j * body_bytes(fmt);
        if (!decoded && !ahead && high_bytes(fmt)) touch_lines(blk, body_bytes(fmt));   /* two planes: in order */
        if (!decoded && ahead)   /* the header's lines spread over the blocks */
            for (int64_t l = j; l < header_bytes(fmt) / 64; l += unit_blocks(fmt))
                __builtin_prefetch(unit + ahead + l * 64, 0, 1);
        v16i da[ROWS][2], db[ROWS][2];   /* Q6_K, Q3_K: the block's two 16-k halves apart */
        for (int r = 0; r < mr; r++) da[r][0] = da[r][1] = db[r][0] = db[r][1] = vzero();
        KQ_UNROLL_GROUPS
        for (int g = 0; g < 8; g++) {
            v16i lo, hi;
            if (decoded) {
                lo = vload(decoded + (j * 8 + g) * 128);
                hi = vload(decoded + (j * 8 + g) * 128 + 64);
            } else {
                if (ahead)   /* the block's lines in order, spread over its groups */
                    for (int64_t l = g * (body_bytes(fmt) / 64) / 8; l < (g + 1) * (body_bytes(fmt) / 64) / 8; l++)
                        __builtin_prefetch(blk + ahead + l * 64, 0, 1);
                group_codes(fmt, blk, g, &lo, &hi);
            }
            for (int r = 0; r < mr; r++) {
                const int8_t *xq = x[r].q + j * 32 + g * 4;
                if (halves(fmt) && g >= 4) {
                    db[r][0] = vdot(db[r][0], lo, xq);
                    db[r][1] = vdot(db[r][1], hi, xq);
                } else if (wide_codes(fmt)) {
                    da[r][0] = vdotw(da[r][0], lo, xq);
                    da[r][1] = vdotw(da[r][1], hi, xq);
                } else {
                    da[r][0] = vdot(da[r][0], lo, xq);
                    da[r][1] = vdot(da[r][1], hi, xq);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (!halves(fmt)) {
                weigh_block(fmt, mr, unit, j, h, x, da, si);
            } else {   /* offsets 32 (Q6_K), 4 (Q3_K) times each half's sum */
                const v16i sa = vi8(unit + 64 + (2 * j) * 32 + h * 16), sb = vi8(unit + 64 + (2 * j + 1) * 32 + h * 16);
                const int sh = fmt == FMT_Q3_K ? 3 : 0;
                for (int r = 0; r < mr; r++) {
                    const v16i a = vsub(da[r][h], vset(x[r].o16[2 * j] >> sh));
                    const v16i b = vsub(db[r][h], vset(x[r].o16[2 * j + 1] >> sh));
                    si[r][h] = vadd(si[r][h], vadd(vmul(sa, a), vmul(sb, b)));
                }
            }
        }
    }
    if (fmt == FMT_Q4_K || fmt == FMT_Q5_K)   /* sm = sum_j m_j bsum_j, two blocks per int16 pair */
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 4; p++) {
                const v16i ml = vu8(unit + 384 + p * 32 + h * 16);
                const v16i s0 = vu8(unit + 128 + 2 * p * 32 + h * 16), s1 = vu8(unit + 128 + (2 * p + 1) * 32 + h * 16);
                const v16i m = vpair(vor(vand8(ml, 15), vand8(vshift(s0, -2), 0x30)),
                                     vor(vand8(vshift(ml, -4), 15), vand8(vshift(s1, -2), 0x30)));
                for (int r = 0; r < mr; r++)
                    sm[r][h] = vdot16(sm[r][h], m, (int32_t)((uint32_t)(uint16_t)x[r].bs32[2 * p] |
                                                              (uint32_t)x[r].bs32[2 * p + 1] << 16));
            }
    for (int h = 0; h < 2; h++) {
        const v16f d = vf16(unit + h * 32);
        if (fmt == FMT_Q5_1) {   /* d q + m per weight: the min meets the block's sum */
            const v16f m = vf16(unit + 64 + h * 32);
            for (int r = 0; r < mr; r++) {
                const v16f t = vfma(d, vcvt(si[r][h]), vfmul(m, vfset((float)x[r].bs32[0])));
                add_sum(y, acc, r, h, vfset(x[r].du), t);
            }
        } else if (fmt != FMT_Q4_K && fmt != FMT_Q5_K) {
            for (int r = 0; r < mr; r++)
                add_sum(y, acc, r, h, vfmul(d, vfset(x[r].du)), vcvt(si[r][h]));
        } else {
            const v16f dmin = vf16(unit + 64 + h * 32);
            for (int r = 0; r < mr; r++) {
                const v16f t = vfms(d, vcvt(si[r][h]), vfmul(dmin, vcvt(sm[r][h])));
                add_sum(y, acc, r, h, vfset(x[r].du), t);
            }
        }
    }
}

/* A unit's codes, 8 blocks x 8 groups x (channels 0-15, 16-31) x 64 bytes, for passes over many rows. */
KQV void decode_unit(const int fmt, const uint8_t *unit, uint8_t *out) {
    for (int64_t i = 0; i < unit_bytes(fmt); i += 64) __builtin_prefetch(unit + PREFETCH_BYTES(fmt) + i, 0, 1);
    for (int j = 0; j < unit_blocks(fmt); j++) {
        const uint8_t *blk = unit + header_bytes(fmt) + j * body_bytes(fmt);
        KQ_UNROLL_GROUPS
        for (int g = 0; g < 8; g++) {
            v16i lo, hi;
            group_codes(fmt, blk, g, &lo, &hi);
            vstore(out + (j * 8 + g) * 128, lo);
            vstore(out + (j * 8 + g) * 128 + 64, hi);
        }
    }
}

KQV void rows_of_unit(const int fmt, const int mr, const uint8_t *unit, const uint8_t *decoded, const kacts_view *a,
                      int64_t u, int64_t r0, v16f (*y)[2], float (*acc)[NR], const int64_t ahead) {
    row_unit x[ROWS];
    const int64_t K = a->K, uk = unit_k(fmt);
    for (int r = 0; r < mr; r++) {
        const int64_t row = r0 + r;
        x[r] = (row_unit){a->qx + row * K + u * uk, a->du[row * (K / uk) + u], a->bs32 + row * (K / 32) + u * (uk / 32),
                          halves(fmt) ? a->o16 + row * (K / 16) + u * 16 : a->o16};
    }
    unit_rows(fmt, mr, unit, decoded, x, y, acc, ahead);
}

/* Rows [r0, r0 + mr) of every unit read from the panel, their sums in registers from the first unit to the last;
 * the lines asked for `ahead` bytes before they are read, or (0) touched in order (see PREFETCH_BYTES). */
KQV void rows_in_registers(const int fmt, const int mr, const uint8_t *wp, const kacts_view *a, int64_t r0,
                           float (*acc)[NR], const int64_t ahead) {
    v16f y[ROWS][2];
    for (int r = 0; r < mr; r++) y[r][0] = y[r][1] = vfset(0.f);
    for (int64_t u = 0; u < a->K / unit_k(fmt); u++)
        rows_of_unit(fmt, mr, wp + u * unit_bytes(fmt), NULL, a, u, r0, y, NULL, ahead);
    for (int r = 0; r < mr; r++) {
        vfstore(acc[r0 + r], y[r][0]);
        vfstore(acc[r0 + r] + 16, y[r][1]);
    }
}

/* A constant row count per instance keeps the sums in registers. */
#if ROWS >= 4
#define BY_ROWS(mr, call) switch (mr) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; default: call(4); }
#else
#define BY_ROWS(mr, call) { (void)(mr); call(1); }
#endif

KQV void panel_k(const int fmt, const uint8_t *wp, const kacts_view *a, int64_t M, float (*acc)[NR]) {
    const int64_t units = a->K / unit_k(fmt);
    if (KQ_TOUCH_INSTANCES && M <= TOUCH_ROWS) {   /* the lines touched in order: no test in the loops */
        for (int64_t r = 0; r < M; r += ROWS) {
            if (ROWS >= 2 && M - r >= 2) rows_in_registers(fmt, ROWS >= 2 ? 2 : 1, wp, a, r, acc, 0);
            else rows_in_registers(fmt, 1, wp, a, r, acc, 0);
        }
        return;
    }
    if (M <= DIRECT_ROWS) {   /* a pass over the panel per ROWS rows (from L1 or L2 after the first) */
        const int64_t ahead = KQ_TOUCH_INSTANCES || M > TOUCH_ROWS ? PREFETCH_BYTES(fmt) : 0;
        for (int64_t r = 0; r < M; r += ROWS) {
#define IN_REGISTERS(n) rows_in_registers(fmt, n, wp, a, r, acc, ahead)
            BY_ROWS((int)(M - r < ROWS ? M - r : ROWS), IN_REGISTERS)
#undef IN_REGISTERS
        }
        return;
    }
    _Alignas(64) uint8_t decoded[8 * 8 * 128];
    for (int64_t u = 0; u < units; u++) {
        decode_unit(fmt, wp + u * unit_bytes(fmt), decoded);
        for (int64_t r = 0; r < M; r += ROWS) {
#define DECODED(n) rows_of_unit(fmt, n, wp + u * unit_bytes(fmt), decoded, a, u, r, NULL, acc + r, 0)
            BY_ROWS((int)(M - r < ROWS ? M - r : ROWS), DECODED)
#undef DECODED
        }
    }
}

/* One instance per format: inlined into one function they left Q5_0's loop spilling its registers
 * (half the speed on Zen 4). */
#define PANEL(F)                                                                                         \
    static __attribute__((noinline)) void panel_##F(const uint8_t *wp, const kacts_view *a, int64_t M, \
                                                    float (*acc)[NR]) {                                  \
        panel_k(FMT_##F, wp, a, M, acc);                                                                 \
    }
PANEL(Q5_0) PANEL(Q5_1) PANEL(IQ4_NL) PANEL(IQ4_XS) PANEL(Q3_K) PANEL(Q4_K) PANEL(Q5_K) PANEL(Q6_K)
#undef PANEL

/* Rows [0, M) (at most 64) of one panel -> y columns [0, nc) (+ bias). Activations row r at offset r:
 * the K-quants' as kq_quantize_row_k writes them, Q5_0's per 32 k (scale du, sum bs32; o16 unused). */
void kq_panel_k(int fmt, const uint8_t *wp, int64_t K, const int8_t *qx, const float *du, const int32_t *bs32,
                const int32_t *o16, const float *bias, float *y, int64_t ldy, int64_t nc, int64_t M) {
    float acc[64][NR];
    memset(acc, 0, sizeof(float) * NR * (size_t)M);
    const kacts_view a = {qx, du, bs32, o16, K};
#if KQ_SETS
    const int done = M > ROWS && M <= DIRECT_ROWS &&   /* one pass (kquant_sets.c) instead of two */
                     !kq_panel_sets(fmt, wp, K, qx, du, bs32, o16, M, acc, PREFETCH_BYTES(fmt));
#else
    const int done = 0;
#endif
    if (!done) switch (fmt) {
        case FMT_Q5_0: panel_Q5_0(wp, &a, M, acc); break;
        case FMT_Q5_1: panel_Q5_1(wp, &a, M, acc); break;
        case FMT_IQ4_NL: panel_IQ4_NL(wp, &a, M, acc); break;
        case FMT_IQ4_XS: panel_IQ4_XS(wp, &a, M, acc); break;
        case FMT_Q3_K: panel_Q3_K(wp, &a, M, acc); break;
        case FMT_Q4_K: panel_Q4_K(wp, &a, M, acc); break;
        case FMT_Q5_K: panel_Q5_K(wp, &a, M, acc); break;
        default: panel_Q6_K(wp, &a, M, acc); break;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.f);
}
