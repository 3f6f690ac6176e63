/* Token embedding lookups on a table kept in the file's blocks (a memory map): the rows of a step's
 * tokens dequantized to float32 in one call. Computed as gguf.quants.dequantize computes them, a scale
 * times a code with one rounding, so a row is the same bits either way; only the formats whose value is
 * exactly that (Q8_0, Q4_0, Q5_0) are here, the others are Python's (model/quant.py). */
#include <string.h>

#include "kernels.h"

static void q8_0_block(const block_q8_0 *b, float *y) {
    const float d = f16_to_f32(b->d);
    for (int j = 0; j < 32; j++) y[j] = d * (float)b->qs[j];
}

static void q4_0_block(const block_q4_0 *b, float *y) {
    const float d = f16_to_f32(b->d);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b->qs[j] & 15) - 8);
        y[j + 16] = d * (float)((b->qs[j] >> 4) - 8);
    }
}

static void q5_0_block(const block_q5_0 *b, float *y) {
    const float d = f16_to_f32(b->d);
    uint32_t qh;
    memcpy(&qh, b->qh, 4);   /* bit j: the fifth bit of value j */
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((b->qs[j] & 15) | ((qh >> j) & 1) << 4) - 16);
        y[j + 16] = d * (float)((int)((b->qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
    }
}

/* out (n, k) = rows ids[0..n) of a (num_rows, k) table in format fmt. Returns 0; -1 for a format not
 * handled here, -2 for a K or row size that does not fit the format, -3 for an id outside the table. */
int kn_embed_rows(int fmt, const uint8_t *table, int64_t num_rows, int64_t row_bytes, const int64_t *ids,
                  int64_t n, int64_t k, float *out) {
    if (fmt != FMT_Q8_0 && fmt != FMT_Q4_0 && fmt != FMT_Q5_0) return -1;
    if (k <= 0 || k % QK || row_bytes != k / QK * kn_file_bytes(fmt)) return -2;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= num_rows) return -3;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = table + ids[r] * row_bytes;
        float *y = out + r * k;
        for (int64_t b = 0; b < k / QK; b++, y += QK) {
            if (fmt == FMT_Q8_0) q8_0_block((const block_q8_0 *)row + b, y);
            else if (fmt == FMT_Q4_0) q4_0_block((const block_q4_0 *)row + b, y);
            else q5_0_block((const block_q5_0 *)row + b, y);
        }
    }
    return 0;
}
