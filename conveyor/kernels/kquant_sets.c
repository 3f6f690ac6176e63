/* kquant_k.c's matmul for a few rows more than its register path holds (AVX-512 VNNI builds: 4 < M <= 8, a
 * decode step of several requests or a speculative verification) in one pass over the weights. The register
 * path makes one pass over the whole panel per 4 rows, the second from L2; here the rows go in sets of
 * SET_ROWS (the last one the rest), and each span of the panel (SPAN_K) serves every set before the next
 * span: read from memory by the first set, from L1 by the other. A set's sums stay in registers over a span.
 * The float steps are the register path's, unit by unit, and the integer sums are exact, so a row's bits do
 * not change with M. The weights' compute, not their bytes, bounds M = 8: 1024 vpdpbusd a Q4_K unit of 4.5
 * KiB, one a cycle on Zen 4.
 */
#include <stdint.h>

#include "kernels.h"
#include "kq_codes.h"
#include "kq_vec.h"

#if KQ_SETS
#define SET_ROWS 4   /* a set's float and integer sums, its block dots and the codes fill the registers */
#define SPAN_K 512   /* k per span: what every set reads before the next span (Q4_K: 9 KiB), kept in L1 */

/* si[r] += block j's share for rows [0, n) of x (channels 0-15, 16-31). The first set asks for the lines `ahead`
 * bytes on as the register path does. Q6_K and Q3_K fold each 16-k half into si as it ends instead of keeping
 * both halves' dots. */
KQV void block_rows(const int fmt, const int n, const uint8_t *unit, const int j, const row_unit *x, v16i (*si)[2],
                    const int64_t ahead) {
    const uint8_t *blk = unit + header_bytes(fmt) + j * body_bytes(fmt);
    if (ahead)   /* as the register path asks: the header's lines spread over the blocks */
        for (int64_t l = j; l < header_bytes(fmt) / 64; l += unit_blocks(fmt))
            __builtin_prefetch(unit + ahead + l * 64, 0, 1);
    v16i da[SET_ROWS][2];
    for (int r = 0; r < n; r++) da[r][0] = da[r][1] = vzero();
    KQ_UNROLL_GROUPS   /* gcc's own limit leaves the five- and six-bit formats' loop rolled, their dots in memory */
    for (int g = 0; g < 8; g++) {
        if (ahead)   /* the block's lines in order, spread over its groups */
            for (int64_t l = g * (body_bytes(fmt) / 64) / 8; l < (g + 1) * (body_bytes(fmt) / 64) / 8; l++)
                __builtin_prefetch(blk + ahead + l * 64, 0, 1);
        v16i lo, hi;
        group_codes(fmt, blk, g, &lo, &hi);
        for (int r = 0; r < n; r++) {
            const int8_t *xq = x[r].q + j * 32 + g * 4;
            da[r][0] = wide_codes(fmt) ? vdotw(da[r][0], lo, xq) : vdot(da[r][0], lo, xq);
            da[r][1] = wide_codes(fmt) ? vdotw(da[r][1], hi, xq) : vdot(da[r][1], hi, xq);
        }
        if (halves(fmt) && g % 4 == 3)   /* a 16-k half done: offsets 32 (Q6_K), 4 (Q3_K) times its sum */
            for (int h = 0; h < 2; h++) {
                const int s = 2 * j + g / 4, sh = fmt == FMT_Q3_K ? 3 : 0;
                const v16i sc = vi8(unit + 64 + s * 32 + h * 16);
                for (int r = 0; r < n; r++) {
                    si[r][h] = vadd(si[r][h], vmul(sc, vsub(da[r][h], vset(x[r].o16[s] >> sh))));
                    da[r][h] = vzero();
                }
            }
    }
    if (!halves(fmt))   /* Q6_K, Q3_K folded their halves above */
        for (int h = 0; h < 2; h++) weigh_block(fmt, n, unit, j, h, x, da, si);
}

/* y[0..n) += rows x[0..n)'s share of one unit (n <= SET_ROWS). */
KQV void unit_set(const int fmt, const int n, const uint8_t *unit, const row_unit *x, v16f (*y)[2], int64_t ahead) {
    v16i si[SET_ROWS][2];
    for (int r = 0; r < n; r++) si[r][0] = si[r][1] = vzero();
    for (int j = 0; j < unit_blocks(fmt); j++) block_rows(fmt, n, unit, j, x, si, ahead);
    for (int h = 0; h < 2; h++) {
        const v16f d = vf16(unit + h * 32);
        if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {   /* the mins meet the sums of 32: sm = sum_j m_j bsum_j */
            v16i m[4];
            for (int p = 0; p < 4; p++) {
                const v16i ml = vu8(unit + 384 + p * 32 + h * 16);
                const v16i s0 = vu8(unit + 128 + 2 * p * 32 + h * 16), s1 = vu8(unit + 128 + (2 * p + 1) * 32 + h * 16);
                m[p] = vpair(vor(vand8(ml, 15), vand8(vshift(s0, -2), 0x30)),
                             vor(vand8(vshift(ml, -4), 15), vand8(vshift(s1, -2), 0x30)));
            }
            const v16f dmin = vf16(unit + 64 + h * 32);
            for (int r = 0; r < n; r++) {
                v16i sm = vzero();
                for (int p = 0; p < 4; p++)
                    sm = vdot16(sm, m[p], (int32_t)((uint32_t)(uint16_t)x[r].bs32[2 * p] |
                                                    (uint32_t)x[r].bs32[2 * p + 1] << 16));
                const v16f t = vfms(d, vcvt(si[r][h]), vfmul(dmin, vcvt(sm)));
                y[r][h] = vfma(vfset(x[r].du), t, y[r][h]);
            }
        } else if (fmt == FMT_Q5_1) {   /* d q + m per weight: the min meets the block's sum */
            const v16f m = vf16(unit + 64 + h * 32);
            for (int r = 0; r < n; r++) {
                const v16f t = vfma(d, vcvt(si[r][h]), vfmul(m, vfset((float)x[r].bs32[0])));
                y[r][h] = vfma(vfset(x[r].du), t, y[r][h]);
            }
        } else {
            for (int r = 0; r < n; r++)
                y[r][h] = vfma(vfmul(d, vfset(x[r].du)), vcvt(si[r][h]), y[r][h]);
        }
    }
}

/* acc[r0..r0 + n) += their share of units [u0, u1), the sums in registers from the first unit to the last. */
KQV void span_set(const int fmt, const int n, const uint8_t *wp, int64_t u0, int64_t u1, const kacts_view *a,
                  int64_t r0, float (*acc)[NR], int64_t ahead) {
    v16f y[SET_ROWS][2];
    for (int r = 0; r < n; r++) y[r][0] = vfload(acc[r0 + r]), y[r][1] = vfload(acc[r0 + r] + 16);
    for (int64_t u = u0; u < u1; u++) {
        row_unit x[SET_ROWS];
        for (int r = 0; r < n; r++) x[r] = unit_of_row(fmt, a, u, r0 + r);
        unit_set(fmt, n, wp + u * unit_bytes(fmt), x, y, ahead);
    }
    for (int r = 0; r < n; r++) vfstore(acc[r0 + r], y[r][0]), vfstore(acc[r0 + r] + 16, y[r][1]);
}

/* A constant row count per instance keeps a set's sums in registers. */
#define BY_SET(n, call) \
    switch (n) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; default: call(4); }

/* Rows [0, M) (M <= 64) in sets of SET_ROWS, the last one the rest, span by span. */
KQV void panel_sets(const int fmt, const uint8_t *wp, const kacts_view *a, int64_t M, float (*acc)[NR], int64_t ahead) {
    const int64_t sets = (M + SET_ROWS - 1) / SET_ROWS, units = a->K / unit_k(fmt), span = SPAN_K / unit_k(fmt);
    int64_t first[64 / SET_ROWS + 1];
    for (int64_t s = 0; s <= sets; s++) first[s] = s * SET_ROWS < M ? s * SET_ROWS : M;
    for (int64_t u0 = 0; u0 < units; u0 += span) {
        const int64_t u1 = u0 + span < units ? u0 + span : units;
        for (int64_t s = 0; s < sets; s++) {
#define SET(n) span_set(fmt, n, wp, u0, u1, a, first[s], acc, s == 0 ? ahead : 0)
            BY_SET((int)(first[s + 1] - first[s]), SET)
#undef SET
        }
    }
}

/* One instance per format, as kquant_k.c's panels. Q4_K keeps the register path's two passes: one pass
 * measured 0.92-1.00 of them on the 7B shapes at M = 5..8 (its codes are the cheapest to decode twice). */
#define SETS(F)                                                                                         \
    static __attribute__((noinline)) void sets_##F(const uint8_t *wp, const kacts_view *a, int64_t M, \
                                                   float (*acc)[NR], int64_t ahead) {                     \
        panel_sets(FMT_##F, wp, a, M, acc, ahead);                                                       \
    }
SETS(Q5_0) SETS(Q5_1) SETS(IQ4_NL) SETS(IQ4_XS) SETS(Q3_K) SETS(Q5_K) SETS(Q6_K)
#undef SETS

int kq_panel_sets(int fmt, const uint8_t *wp, int64_t K, const int8_t *qx, const float *du, const int32_t *bs32,
                  const int32_t *o16, int64_t M, float (*acc)[NR], int64_t ahead) {
    const kacts_view a = {qx, du, bs32, o16, K};
    switch (fmt) {
        case FMT_Q5_0: sets_Q5_0(wp, &a, M, acc, ahead); return 0;
        case FMT_Q5_1: sets_Q5_1(wp, &a, M, acc, ahead); return 0;
        case FMT_IQ4_NL: sets_IQ4_NL(wp, &a, M, acc, ahead); return 0;
        case FMT_IQ4_XS: sets_IQ4_XS(wp, &a, M, acc, ahead); return 0;
        case FMT_Q3_K: sets_Q3_K(wp, &a, M, acc, ahead); return 0;
        case FMT_Q5_K: sets_Q5_K(wp, &a, M, acc, ahead); return 0;
        case FMT_Q6_K: sets_Q6_K(wp, &a, M, acc, ahead); return 0;
        default: return -1;
    }
}
#endif
