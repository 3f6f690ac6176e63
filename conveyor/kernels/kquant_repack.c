/* Repacking GGUF blocks (block_*) into our panels (kn_panel_*, both in kernels.h), in C, straight from
 * the memory-mapped file: one pass per panel, parallel over panels. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* Bytes of a repacked (N, K) weight; -1 when the format cannot take K. */
int64_t kq_packed_bytes(int fmt, int64_t N, int64_t K) {
    const int64_t panels = (N + NR - 1) / NR;
    if (fmt < 0 || fmt >= FMT_END || K % kn_unit_k(fmt)) return -1;
    return panels * (K / kn_unit_k(fmt)) * kn_unit_bytes(fmt);
}

/* ------------------------------------------------------------------ repacking from GGUF blocks */

/* Q4_K / Q5_K: the 6-bit scale and min of 32-k block j from the 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

/* The unsigned codes of one file block (unit_k of them). */
static void file_codes(int fmt, const uint8_t *b, uint8_t *q) {
    if (fmt == FMT_Q8_0) {
        const block_q8_0 *x = (const void *)b;
        for (int e = 0; e < 32; e++) q[e] = (uint8_t)(x->qs[e] + 128);
    } else if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        const uint8_t *qs = fmt == FMT_Q4_0 ? ((const block_q4_0 *)b)->qs : ((const block_q4_1 *)b)->qs;
        for (int e = 0; e < 16; e++) { q[e] = qs[e] & 15; q[e + 16] = qs[e] >> 4; }
    } else if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {
        const block_q5_0 *x0 = (const void *)b;
        const block_q5_1 *x1 = (const void *)b;
        const uint8_t *qs = fmt == FMT_Q5_0 ? x0->qs : x1->qs;
        uint32_t qh;
        memcpy(&qh, fmt == FMT_Q5_0 ? x0->qh : x1->qh, 4);
        for (int e = 0; e < 16; e++) {
            q[e] = (uint8_t)((qs[e] & 15) | ((qh >> e) & 1) << 4);
            q[e + 16] = (uint8_t)((qs[e] >> 4) | ((qh >> (e + 16)) & 1) << 4);
        }
    } else if (fmt == FMT_IQ4_NL || fmt == FMT_IQ4_XS) {   /* table indices, 16 bytes per 32 k */
        const uint8_t *qs = fmt == FMT_IQ4_NL ? ((const block_iq4_nl *)b)->qs : ((const block_iq4_xs *)b)->qs;
        for (int j = 0; j < kn_unit_k(fmt) / 32; j++)
            for (int e = 0; e < 16; e++) { q[32 * j + e] = qs[16 * j + e] & 15; q[32 * j + e + 16] = qs[16 * j + e] >> 4; }
    } else if (fmt == FMT_Q3_K) {   /* 2 low bits from qs, bit 2 from hmask: code = value + 4 */
        const block_q3_k *x = (const void *)b;
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    q[n * 128 + j * 32 + l] = (uint8_t)(((x->qs[n * 32 + l] >> (2 * j)) & 3) |
                                                        ((x->hmask[l] >> (n * 4 + j)) & 1) << 2);
    } else {   /* Q5_K (Q4_K and Q6_K are repacked two channels at a time: repack_pairs) */
        const block_q5_k *x = (const void *)b;
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++)
                q[j * 32 + l] = (uint8_t)(((x->qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 15) |
                                          ((x->qh[l] >> j) & 1) << 4);
    }
}

/* Q3_K's sixteen 6-bit scales (value - 32) from its 12 packed bytes. */
static void scales_q3k(const uint8_t *s, int8_t out[16]) {
    for (int i = 0; i < 16; i++) {
        const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
        const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (int8_t)((low | high << 4) - 32);
    }
}

/* A unit's header for channel c from its file block b. Q5_K's header is laid out as Q4_K's. */
static void unit_header(int fmt, int c, const uint8_t *b, uint8_t *hdr) {
    if (fmt == FMT_Q6_K) {
        const block_q6_k *x = (const void *)b;
        kn_panel_q6_k *u = (void *)hdr;
        memcpy(&u->d[c], &x->d, 2);
        for (int s = 0; s < 16; s++) u->sc[s][c] = x->scales[s];
    } else if (fmt == FMT_Q3_K) {
        const block_q3_k *x = (const void *)b;
        kn_panel_q3_k *u = (void *)hdr;
        int8_t sc[16];
        memcpy(&u->d[c], &x->d, 2);
        scales_q3k(x->scales, sc);
        for (int s = 0; s < 16; s++) u->sc[s][c] = sc[s];
    } else if (fmt == FMT_IQ4_XS) {
        const block_iq4_xs *x = (const void *)b;
        kn_panel_iq4_xs *u = (void *)hdr;
        uint16_t high;
        memcpy(&u->d[c], &x->d, 2);
        memcpy(&high, &x->scales_h, 2);
        for (int j = 0; j < 8; j++)
            u->sc[j][c] = (int8_t)((((x->scales_l[j / 2] >> (4 * (j % 2))) & 15) | ((high >> (2 * j)) & 3) << 4) - 32);
    } else if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {
        const block_q4_k *x = (const void *)b;   /* Q5_K's d, dmin, scales sit as Q4_K's */
        kn_panel_q4_k *u = (void *)hdr;
        uint8_t sc[8], m[8];
        memcpy(&u->d[c], &x->d, 2);
        memcpy(&u->dmin[c], &x->dmin, 2);
        for (int s = 0; s < 8; s++) scale_min_k4(s, x->scales, sc + s, m + s);
        for (int s = 0; s < 8; s++) u->S[s][c] = (uint8_t)(sc[s] | (m[s] >> 4) << 6);
        for (int p = 0; p < 4; p++) u->ML[p][c] = (uint8_t)((m[2 * p] & 15) | (m[2 * p + 1] & 15) << 4);
    } else {   /* Q5_0, IQ4_NL: d; Q5_1: d, m */
        kn_panel_q5_1 *u = (void *)hdr;
        memcpy(&u->d[c], b, 2);
        if (fmt == FMT_Q5_1) memcpy(&u->m[c], &((const block_q5_1 *)b)->m, 2);
    }
}

typedef struct {
    int fmt;
    const uint8_t *raw;
    int64_t row_bytes;
    const int64_t *rows;   /* file row of each output channel, or NULL for the identity */
    int64_t N, K;
    uint8_t *out;
} repack_job;

/* quant.c's layout (kn_panel_q8_0, _q4_0, _q4_1: codes, then d[32], m[32]). */
static void repack_legacy_block(int fmt, int c, const uint8_t *b, const uint8_t *q, uint8_t *blk) {
    const int64_t codes = code_bytes(fmt);
    for (int k = 0; k < QK; k++) {
        const int g = k / 4, i = k % 4;
        if (fmt == FMT_Q8_0) blk[g * 128 + c * 4 + i] = q[k];
        else blk[g * 64 + (c % 16) * 4 + i] |= (uint8_t)(q[k] << (c < 16 ? 0 : 4));
    }
    memcpy(blk + codes + 2 * c, b, 2);   /* d leads each of the three file blocks */
    if (fmt == FMT_Q4_1) memcpy(blk + codes + 64 + 2 * c, &((const block_q4_1 *)b)->m, 2);
}

/* The file row of output channel n (the row order's, or the identity). */
static inline const uint8_t *file_row(const repack_job *j, int64_t n) {
    return j->raw + (j->rows ? j->rows[n] : n) * j->row_bytes;
}

/* Q4_K and Q6_K (most of a Q4_K_M file) two channels at a time: a byte of our block holds channel c's bits in
 * its low half and c + 16's in its high one, so each byte is built from both channels' file bytes at once
 * rather than or-ed in code by code (kernels.h's kn_panel_q4_k / kn_panel_q6_k). `blk`: the unit's first
 * block; b is a zero block where channel c + 16 is past N. */
typedef void (*pair_body)(const uint8_t *a, const uint8_t *b, uint8_t *blk, int c);

/* Q4_K: a block's 32 codes of a channel are one nibble of 32 file bytes. */
static void q4k_pair(const uint8_t *a, const uint8_t *b, uint8_t *blk, int c) {
    const uint8_t *qa = ((const block_q4_k *)a)->qs, *qb = ((const block_q4_k *)b)->qs;
    for (int kb = 0; kb < 8; kb++, blk += body_bytes(FMT_Q4_K)) {
        const int sh = 4 * (kb % 2);
        const uint8_t *sa = qa + (kb / 2) * 32, *sb = qb + (kb / 2) * 32;
        uint8_t bytes[32];
        for (int l = 0; l < 32; l++) bytes[l] = (uint8_t)(((sa[l] >> sh) & 15) | ((sb[l] >> sh) & 15) << 4);
        for (int g = 0; g < 8; g++) memcpy(blk + low_line(FMT_Q4_K, g) + c * 4, bytes + g * 4, 4);
    }
}

/* Q6_K: a low-plane byte holds both channels' 4 low bits, a high-plane byte both channels' 2 high bits in two
 * neighbouring groups. */
static void q6k_pair(const uint8_t *a, const uint8_t *b, uint8_t *blk, int c) {
    const block_q6_k *x = (const void *)a, *y = (const void *)b;
    for (int kb = 0; kb < 8; kb++, blk += body_bytes(FMT_Q6_K)) {   /* file half kb / 4, quarter q */
        const int half = kb / 4, q = kb % 4, sh = 4 * (q / 2), hsh = 2 * q;
        const uint8_t *la = x->ql + half * 64 + (q % 2) * 32, *lb = y->ql + half * 64 + (q % 2) * 32;
        const uint8_t *ha = x->qh + half * 32, *hb = y->qh + half * 32;
        uint8_t low[32], high[32];
        for (int l = 0; l < 32; l++) {
            low[l] = (uint8_t)(((la[l] >> sh) & 15) | ((lb[l] >> sh) & 15) << 4);
            high[l] = (uint8_t)(((ha[l] >> hsh) & 3) | ((hb[l] >> hsh) & 3) << 2);
        }
        for (int g = 0; g < 8; g++) memcpy(blk + low_line(FMT_Q6_K, g) + c * 4, low + g * 4, 4);
        for (int g = 0; g < 8; g += 2) {   /* groups g and g + 1 share a high-plane line */
            uint8_t both[4];
            for (int i = 0; i < 4; i++) both[i] = (uint8_t)(high[g * 4 + i] | high[(g + 1) * 4 + i] << 4);
            memcpy(blk + high_line(FMT_Q6_K, g) + c * 4, both, 4);
        }
    }
}

static void repack_pairs(const repack_job *j, int64_t p, uint8_t *panel, int64_t units, pair_body body) {
    static const uint8_t none[256];   /* a missing channel's file block: zero codes */
    _Static_assert(sizeof(block_q4_k) <= sizeof none && sizeof(block_q6_k) <= sizeof none, "none: a file block");
    const int fmt = j->fmt;
    const int64_t ub = kn_unit_bytes(fmt), fb = kn_file_bytes(fmt);
    for (int c = 0; c < NR / 2; c++) {
        const int64_t n = p * NR + c, m = n + NR / 2;
        if (n >= j->N) break;
        const uint8_t *row_a = file_row(j, n), *row_b = m < j->N ? file_row(j, m) : NULL;
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *a = row_a + u * fb, *b = row_b ? row_b + u * fb : none;
            uint8_t *unit = panel + u * ub;
            unit_header(fmt, c, a, unit);
            if (row_b) unit_header(fmt, c + NR / 2, b, unit);
            body(a, b, unit + header_bytes(fmt), c);
        }
    }
}

static void repack_panel(void *arg, int64_t p) {
    const repack_job *j = arg;
    const int fmt = j->fmt;
    const int legacy = legacy_format(fmt);
    const int64_t uk = kn_unit_k(fmt), units = j->K / uk, blocks = uk / QK, ub = kn_unit_bytes(fmt);
    const int64_t fb = kn_file_bytes(fmt);
    uint8_t *panel = j->out + p * units * ub;
    memset(panel, 0, (size_t)(units * ub));   /* channels past N: zero codes and scales */
    if (fmt == FMT_Q4_K || fmt == FMT_Q6_K) {
        repack_pairs(j, p, panel, units, fmt == FMT_Q4_K ? q4k_pair : q6k_pair);
        return;
    }
    uint8_t q[256];
    for (int c = 0; c < NR; c++) {
        const int64_t n = p * NR + c;
        if (n >= j->N) break;
        const uint8_t *row = file_row(j, n);
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *b = row + u * fb;
            uint8_t *unit = panel + u * ub, *hdr = unit;
            file_codes(fmt, b, q);
            if (legacy) { repack_legacy_block(fmt, c, b, q, unit); continue; }
            unit_header(fmt, c, b, hdr);
            const int low_bits = fmt == FMT_Q3_K ? 2 : 4;
            for (int64_t kb = 0; kb < blocks; kb++) {
                uint8_t *blk = unit + header_bytes(fmt) + kb * body_bytes(fmt);
                const uint8_t *qb = q + kb * QK;
                const int shift = c < 16 ? 0 : 4;
                for (int g = 0; g < 8; g++) {   /* a channel's 4 k of a group are 4 adjacent bytes */
                    uint32_t lo = 0, hi = 0, word;
                    for (int i = 0; i < 4; i++) {
                        lo |= (uint32_t)(qb[g * 4 + i] & ((1 << low_bits) - 1)) << (8 * i);
                        hi |= (uint32_t)(qb[g * 4 + i] >> low_bits) << (8 * i);
                    }
                    uint8_t *dst = blk + low_line(fmt, g) + (c % 16) * 4;
                    memcpy(&word, dst, 4);
                    word |= lo << (low_bits == 2 ? 4 * (g % 2) + 2 * (c >= 16) : shift);
                    memcpy(dst, &word, 4);
                    if (high_bytes(fmt) == 0) continue;
                    dst = blk + high_line(fmt, g) + (c % 16) * 4;
                    memcpy(&word, dst, 4);
                    word |= hi << (2 * (g % 4) + (c >= 16));   /* this channel's high bits of group g */
                    memcpy(dst, &word, 4);
                }
            }
        }
    }
}

/* GGUF blocks of an (N, K) weight (row r at raw + r * row_bytes) -> our panels in `out`
 * (kq_packed_bytes long; quant.c's layout for Q8_0 / Q4_0 / Q4_1). Returns 0, or -1 for a format or
 * K it cannot take. */
int kq_repack(int fmt, const uint8_t *raw, int64_t row_bytes, const int64_t *rows, int64_t N, int64_t K,
              uint8_t *out, int64_t num_threads) {
    if (fmt < 0 || fmt >= FMT_END) return -1;
    const int64_t uk = kn_unit_k(fmt), fb = kn_file_bytes(fmt);
    if (K % uk || row_bytes < K / uk * fb) return -1;
    repack_job job = {fmt, raw, row_bytes, rows, N, K, out};
    pool_for((N + NR - 1) / NR, repack_panel, &job, num_threads);
    return 0;
}

