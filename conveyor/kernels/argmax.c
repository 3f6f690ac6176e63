/* The greedy rows' argmax: each row's first index of its largest value, a NaN counting as larger than any
 * number (the first NaN wins), as numpy's and torch's argmax give. A row is split into spans the pool's
 * threads scan at once (a 150k vocabulary's logits are 600 KB, half of them in the other core's cache
 * after the output layer), then the spans' results are merged in order.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "pool.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ARGMAX_SPAN 16384   /* values per work item: a row of a 150k vocabulary is split ten ways */

typedef struct {
    const float *logits;
    int64_t stride, vocab, spans;   /* spans per row */
    float *best;                    /* [n * spans]: the span's largest number (-inf if none) */
    int64_t *nan_at;                /* [n * spans]: the span's first NaN, or -1 */
} argmax_job;

static void argmax_item(void *arg, int64_t item) {
    const argmax_job *j = arg;
    const int64_t row = item / j->spans, span = item % j->spans, first = span * ARGMAX_SPAN;
    const int64_t end = first + ARGMAX_SPAN < j->vocab ? first + ARGMAX_SPAN : j->vocab;
    const float *x = j->logits + row * j->stride;
    float best = -INFINITY;
    int any_nan = 0;
    int64_t i = first;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + 16 <= end; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        m = _mm512_max_ps(v, m);   /* a NaN v leaves m as it was */
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    best = _mm512_reduce_max_ps(m);
    any_nan = nan != 0;
#endif
    for (; i < end; i++) {
        best = x[i] > best ? x[i] : best;
        any_nan |= x[i] != x[i];
    }
    int64_t at = -1;
    for (int64_t k = first; any_nan && k < end; k++)
        if (x[k] != x[k]) {
            at = k;
            break;
        }
    j->best[item] = best;
    j->nan_at[item] = at;
}

/* out[i] = row i's argmax, rows `stride` floats apart; -1 for an empty shape. */
int argmax_rows(const float *logits, int64_t stride, int64_t n, int64_t vocab, int64_t *out, int64_t num_threads) {
    if (n < 1 || vocab < 1) return -1;
    const int64_t spans = (vocab + ARGMAX_SPAN - 1) / ARGMAX_SPAN;
    float best_buf[64];
    int64_t nan_buf[64];
    if (n * spans > 64) {   /* many rows: one at a time, each split into its spans */
        for (int64_t r = 0; r < n; r++)
            if (argmax_rows(logits + r * stride, stride, 1, vocab, out + r, num_threads) != 0) return -1;
        return 0;
    }
    argmax_job job = {logits, stride, vocab, spans, best_buf, nan_buf};
    pool_for(n * spans, argmax_item, &job, n * spans * ARGMAX_SPAN < 65536 ? 1 : num_threads);
    for (int64_t r = 0; r < n; r++) {
        const float *x = logits + r * stride;
        const float *best = best_buf + r * spans;
        const int64_t *nan_at = nan_buf + r * spans;
        int64_t at = -1, span = 0;
        for (int64_t s = 0; s < spans && at < 0; s++) at = nan_at[s];
        if (at < 0) {
            for (int64_t s = 1; s < spans; s++)
                if (best[s] > best[span]) span = s;   /* the first span holding the largest number */
            const int64_t end = (span + 1) * ARGMAX_SPAN < vocab ? (span + 1) * ARGMAX_SPAN : vocab;
            for (int64_t k = span * ARGMAX_SPAN; k < end; k++)
                if (x[k] == best[span]) {
                    at = k;
                    break;
                }
            if (at < 0) at = span * ARGMAX_SPAN;   /* not reached: a span's largest number is one of its values */
        }
        out[r] = at;
    }
    return 0;
}
