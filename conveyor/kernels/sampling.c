/* Sampling helpers: the structured-output token mask, applied in place (argmax.c: the greedy rows' argmax).
 *
 * A grammar's allowed tokens come as xgrammar's packed bitmask (bit j of 32-bit word w allows token
 * 32 * w + j). Unpacking it into a bool tensor and masking costs milliseconds per step in torch at a
 * 49k vocabulary; here a word of all ones (most of the vocabulary inside a JSON string) is skipped
 * with one compare, and only refused tokens are written.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* For each of the n rows: logits[rows[i] * stride + t] = -inf for every t < vocab whose bit is clear in
 * masks[i * words ...]. alive[i] = 1 when the row keeps a logit above -inf (0: nothing left to sample). */
void mask_logits(float *logits, int64_t stride, const int64_t *rows, int64_t n, const int32_t *masks,
                 int64_t words, int64_t vocab, int32_t *alive) {
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * stride;
        const uint32_t *mask = (const uint32_t *)(masks + i * words);
        int any = 0;
        for (int64_t w = 0; w < words; w++) {
            int64_t base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) {
                for (int64_t t = base; t < end && !any; t++) any = row[t] > -INFINITY;
                continue;
            }
            if (bits == 0) {
                for (int64_t t = base; t < end; t++) row[t] = -INFINITY;
                continue;
            }
            for (int64_t t = base; t < end; t++) {
                if ((bits >> (t - base)) & 1u) {
                    any |= row[t] > -INFINITY;
                } else {
                    row[t] = -INFINITY;
                }
            }
        }
        alive[i] = any;
    }
}
