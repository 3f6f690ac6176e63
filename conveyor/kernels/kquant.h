/* The repacked layout of the kept formats, shared by the repacking (kquant_repack.c) and the kernels
 * (quant.c: Q8_0 / Q4_0 / Q4_1; kquant_k.c: Q5_0, Q4_K, Q5_K, Q6_K; kquant.c runs a linear layer).
 *
 * A panel holds NR = 32 output channels: a run of units along K, each a header of per-channel scales
 * then its 32-k blocks. A block's 512 bytes of nibbles are u8[8 groups][16][4 k], low nibble channel
 * c, high nibble channel c + 16: one 64-byte load serves all 32 channels of a group. High bits follow:
 *   Q5_*, Q3_K  u8[2][16][4 k]: byte (g / 4), bit 2 (g % 4) for channel c, + 1 for c + 16  128 B
 *   Q6_K  u8[4][16][4 k]: byte (g / 2), bits 4 (g % 2) for channel c, + 2 for c + 16    256 B
 * so the high bits of a group line up with its nibbles. Q3_K's low 2 bits take the nibbles' place as
 * u8[4][16][4 k]: byte (g / 2), bits 4 (g % 2) for channel c, + 2 for c + 16 (256 B); IQ4's nibbles
 * index its table of values. Headers below (header_bytes). */
#ifndef CONVEYOR_KQUANT_H
#define CONVEYOR_KQUANT_H
#include <stdint.h>

#define QK 32   /* weights per block along K */
#define NR 32   /* output channels per panel */

enum {
    FMT_Q8 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_Q5_0 = 3, FMT_Q4_K = 4, FMT_Q5_K = 5, FMT_Q6_K = 6,
    FMT_Q5_1 = 7, FMT_IQ4_NL = 8, FMT_IQ4_XS = 9, FMT_Q3_K = 10, FMT_END
};

/* ------------------------------------------------------------------ format geometry (kquant_k.c's formats) */

/* Weights per unit along K: one file block (32) or a K-quant super-block (256). */
static inline int64_t unit_k(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_IQ4_NL ? 32 : 256; }
static inline int64_t header_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q5_0: case FMT_IQ4_NL: return 64;             /* d[32] */
        case FMT_Q5_1: return 128;                             /* d[32] m[32] */
        case FMT_IQ4_XS: return 320;                           /* d[32], sc[8][32] i8 */
        case FMT_Q6_K: case FMT_Q3_K: return 576;              /* d[32], sc[16][32] i8 */
        default: return 512;   /* Q4_K, Q5_K: d[32] dmin[32], S[8][32] = sc_j | (m_j >> 4) << 6,
                                * ML[4][32] = m_2p & 15 | (m_2p+1 & 15) << 4: the file's 6-bit bytes */
    }
}
/* The low bits' plane of a block (nibbles; Q3_K: 2 bits), then its high bits' plane. */
static inline int64_t low_bytes(int fmt) { return fmt == FMT_Q3_K ? 256 : 512; }
static inline int64_t high_bytes(int fmt) {
    return fmt == FMT_Q6_K ? 256 : fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_Q5_K || fmt == FMT_Q3_K ? 128 : 0;
}
static inline int64_t body_bytes(int fmt) { return low_bytes(fmt) + high_bytes(fmt); }
/* Where group g's (4 k of 32 channels) low and high bits start in its block. Q6_K's planes alternate,
 * two low lines then their high line, so a block is read front to back; the others' high plane
 * follows the whole low plane. */
static inline int64_t low_line(int fmt, int g) {
    return fmt == FMT_Q6_K ? (g / 2) * 192 + (g % 2) * 64 : fmt == FMT_Q3_K ? (g / 2) * 64 : g * 64;
}
static inline int64_t high_line(int fmt, int g) {
    return fmt == FMT_Q6_K ? (g / 2) * 192 + 128 : low_bytes(fmt) + (g / 4) * 64;
}
static inline int64_t unit_bytes(int fmt) { return header_bytes(fmt) + unit_k(fmt) / QK * body_bytes(fmt); }
/* The file's block: bytes per unit_k weights of one row (32 for Q8_0, Q4_0, Q4_1). */
static inline int64_t file_block_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q8: return 34;
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q5_0: return 22;
        case FMT_Q5_1: return 24;
        case FMT_IQ4_NL: return 18;
        case FMT_IQ4_XS: return 136;
        case FMT_Q3_K: return 110;
        case FMT_Q4_K: return 144;
        case FMT_Q5_K: return 176;
        default: return 210;
    }
}
/* Formats whose activations are quantized per 256 k (llama.cpp's Q8_K); the others' per 32 k. */
static inline int acts256(int fmt) { return fmt >= FMT_Q4_K && fmt != FMT_Q5_1 && fmt != FMT_IQ4_NL && fmt < FMT_END; }
/* IQ4's codes are a table's values + 128 (up to 241): a dot needs more than int16 pairs. */
static inline int wide_codes(int fmt) { return fmt == FMT_IQ4_NL || fmt == FMT_IQ4_XS; }

float kq_half_to_float(uint16_t h);
int64_t quant_panel_bytes(int fmt, int64_t K);   /* quant.c: one panel of its formats */

/* kquant_k.c: Q8_K-style activations (per 256-k unit: scale; sums per 32; 32 x sums per 16) and a panel. */
void kq_quantize_row_k(const float *x, int64_t K, int8_t *q, float *du, int32_t *bs32, int32_t *o16);
void kq_panel_k(int fmt, const uint8_t *wp, int64_t K, const int8_t *qx, const float *du, const int32_t *bs32,
                const int32_t *o16, const float *bias, float *y, int64_t ldy, int64_t nc, int64_t M);

#endif
