/* A K-quant panel's codes and the rows' activations per unit, as kquant_k.c and kquant_sets.c read them:
 * group_codes turns a group (4 k of 32 channels) of a block into unsigned bytes for vpdpbusd.
 */
#ifndef CONVEYOR_KQ_CODES_H
#define CONVEYOR_KQ_CODES_H
#include <stdint.h>

#include "kernels.h"
#include "kq_vec.h"

/* IQ4's table with 128 added: unsigned codes for vpdpbusd, the 128 taken off with the activations' sums. */
static const uint8_t IQ4_CODES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* Codes of group g (4 k) of a block for channels 0-15 (lo) and 16-31 (hi); see kernels.h's planes. */
KQV void group_codes(const int fmt, const uint8_t *blk, const int g, v16i *lo, v16i *hi) {
    if (fmt == FMT_Q3_K) {   /* 2 low bits, then bit 2 from a Q5-style plane */
        const v16i v = vload(blk + low_line(fmt, g)), u = vload(blk + high_line(fmt, g));
        const int t = g % 2, w = g % 4;
        *lo = vor(vand8(vshift(v, -4 * t), 0x03), vand8(vshift(u, 2 - 2 * w), 0x04));
        *hi = vor(vand8(vshift(v, -4 * t - 2), 0x03), vand8(vshift(u, 1 - 2 * w), 0x04));
        return;
    }
    const v16i v = vload(blk + low_line(fmt, g));
    *lo = vand8(v, 0x0f);
    *hi = vand8(vshift(v, -4), 0x0f);
    if (fmt == FMT_IQ4_NL || fmt == FMT_IQ4_XS) {
        *lo = vlut(*lo, IQ4_CODES);
        *hi = vlut(*hi, IQ4_CODES);
    } else if (fmt == FMT_Q5_K || fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {   /* bits 2t, 2t + 1 of plane byte g / 4 -> bit 4 */
        const v16i u = vload(blk + high_line(fmt, g));
        const int t = g % 4;
        *lo = vor(*lo, vand8(vshift(u, 4 - 2 * t), 0x10));
        *hi = vor(*hi, vand8(vshift(u, 3 - 2 * t), 0x10));
    } else if (fmt == FMT_Q6_K) {   /* bits 4t..4t+1, 4t+2..4t+3 of plane byte g / 2 -> bits 4, 5 */
        const v16i u = vload(blk + high_line(fmt, g));
        const int t = g % 2;
        *lo = vor(*lo, vand8(vshift(u, 4 - 4 * t), 0x30));
        *hi = vor(*hi, vand8(vshift(u, 2 - 4 * t), 0x30));
    }
}

/* Reads lines [p, p + bytes) in ascending order, their values unused. A unit's header (scales) is read
 * after its blocks' codes and a block's high plane beside its low one; in that order the hardware
 * prefetcher falls behind (one core, one row, Q4_K from memory: 11 GB/s without software prefetch, 22
 * with it), and touched first, in order, it runs ahead on its own (28-30 GB/s, the stream read's rate;
 * a software prefetch as well only competes with it). Where a line's dot products take longer (more
 * rows) it no longer keeps ahead: kquant_k.c's TOUCH_ROWS. */
KQV void touch_lines(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) (void)((const volatile uint8_t *)p)[i];
}

typedef struct {
    const int8_t *q;        /* this unit's codes */
    float du;
    const int32_t *bs32;    /* this unit's sums of 32 */
    const int32_t *o16;     /* this unit's 16 values 32 * (sum of 16) (Q6_K) */
} row_unit;

static inline int unit_blocks(int fmt) { return unit_k(fmt) / QK; }
/* Formats whose scales sit per 16-k half of a block (the dots of the halves kept apart). */
static inline int halves(int fmt) { return fmt == FMT_Q6_K || fmt == FMT_Q3_K; }

typedef struct {   /* row r's: codes at qx + r K, scale per unit, sums per 32 (and 32 x sums per 16) */
    const int8_t *qx;
    const float *du;
    const int32_t *bs32, *o16;
    int64_t K;
} kacts_view;

/* si[r][h] (r < n) += block j's dots da[r][h] weighed by the block's scale and offset, for the formats
 * whose block is one 32-k scale (Q6_K and Q3_K weigh each 16-k half: their callers' own). */
KQV void weigh_block(const int fmt, const int n, const uint8_t *unit, const int j, const int h, const row_unit *x,
                     v16i (*da)[2], v16i (*si)[2]) {
    if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_IQ4_NL) {   /* one block: its zero point */
        const int32_t zero = fmt == FMT_Q5_0 ? 16 : fmt == FMT_IQ4_NL ? 128 : 0;
        for (int r = 0; r < n; r++) si[r][h] = vsub(da[r][h], vset(zero * x[r].bs32[0]));
    } else if (fmt == FMT_IQ4_XS) {
        const v16i sc = vi8(unit + 64 + j * 32 + h * 16);
        for (int r = 0; r < n; r++) si[r][h] = vadd(si[r][h], vmul(sc, vsub(da[r][h], vset(128 * x[r].bs32[j]))));
    } else {   /* Q4_K, Q5_K: the scale is S's low 6 bits; the mins meet the sums once a unit */
        const v16i sc = vand8(vu8(unit + 128 + j * 32 + h * 16), 63);
        for (int r = 0; r < n; r++) si[r][h] = vadd(si[r][h], vmul(sc, da[r][h]));
    }
}

/* Row `row`'s activations for unit u (kquant_k.c spells it out: this call there changes its AVX2 code). */
KQV row_unit unit_of_row(const int fmt, const kacts_view *a, int64_t u, int64_t row) {
    const int64_t K = a->K, uk = unit_k(fmt);
    return (row_unit){a->qx + row * K + u * uk, a->du[row * (K / uk) + u], a->bs32 + row * (K / 32) + u * (uk / 32),
                      halves(fmt) ? a->o16 + row * (K / 16) + u * 16 : a->o16};
}

#endif
