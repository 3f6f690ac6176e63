/* The repacked layout of the kept formats, shared by the repacking (kquant_repack.c) and the kernels
 * (quant.c: Q8_0 / Q4_0 / Q4_1; kquant_k.c: Q5_0, Q4_K, Q5_K, Q6_K; kquant.c runs a linear layer).
 *
 * A panel holds NR = 32 output channels: a run of units along K, each a header of per-channel scales
 * then its 32-k blocks. A block's 512 bytes of nibbles are u8[8 groups][16][4 k], low nibble channel
 * c, high nibble channel c + 16: one 64-byte load serves all 32 channels of a group. High bits follow:
 *   Q5_0, Q5_K  u8[2][16][4 k]: byte (g / 4), bit 2 (g % 4) for channel c, + 1 for c + 16  128 B
 *   Q6_K  u8[4][16][4 k]: byte (g / 2), bits 4 (g % 2) for channel c, + 2 for c + 16    256 B
 * so the high bits of a group line up with its nibbles. Headers: Q5_0 d[32] f16; Q4_K / Q5_K d[32]
 * dmin[32] f16, sc[8][32] m[8][32] u8; Q6_K d[32] f16, sc[16][32] i8. */
#ifndef CONVEYOR_KQUANT_H
#define CONVEYOR_KQUANT_H
#include <stdint.h>

#define QK 32   /* weights per block along K */
#define NR 32   /* output channels per panel */

enum { FMT_Q8 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_Q5_0 = 3, FMT_Q4_K = 4, FMT_Q5_K = 5, FMT_Q6_K = 6, FMT_END };

/* ------------------------------------------------------------------ format geometry */

static inline int64_t unit_k(int fmt) { return fmt == FMT_Q5_0 ? 32 : 256; }
static inline int64_t header_bytes(int fmt) { return fmt == FMT_Q5_0 ? 64 : fmt == FMT_Q6_K ? 576 : 640; }
static inline int64_t high_bytes(int fmt) { return fmt == FMT_Q6_K ? 256 : fmt == FMT_Q4_K ? 0 : 128; }
static inline int64_t body_bytes(int fmt) { return 512 + high_bytes(fmt); }
static inline int64_t unit_bytes(int fmt) { return header_bytes(fmt) + unit_k(fmt) / QK * body_bytes(fmt); }
/* The file's block: bytes per unit_k weights of one row. */
static inline int64_t file_block_bytes(int fmt) {
    return fmt == FMT_Q5_0 ? 22 : fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210;
}

float kq_half_to_float(uint16_t h);
int64_t quant_panel_bytes(int fmt, int64_t K);   /* quant.c: one panel of its formats */
static inline int is_kquant(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K; }   /* per-256 activations */

/* kquant_k.c: Q8_K-style activations (per 256-k unit: scale; sums per 32; 32 x sums per 16) and a panel. */
void kq_quantize_row_k(const float *x, int64_t K, int8_t *q, float *du, int32_t *bs32, int32_t *o16);
void kq_panel_k(int fmt, const uint8_t *wp, int64_t K, const int8_t *qx, const float *du, const int32_t *bs32,
                const int32_t *o16, const float *bias, float *y, int64_t ldy, int64_t nc, int64_t M);

#endif
