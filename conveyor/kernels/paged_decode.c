/* Decode attention over a paged KV cache: one query token per row, fused gather + softmax + sum.
 *
 * Reads each key and value of a row's context exactly once (torch would gather the blocks into a
 * padded copy first, then read that copy again). Work items are (row, kv head) pairs; each handles
 * the G = H / KV query heads that share a kv head, so GQA costs no extra memory traffic.
 *
 * q:        [B, H, D]            float32
 * k_cache:  [num_blocks, bs, KV, D] float32 (v_cache the same)
 * tables:   [B, max_blocks]      int64 block ids
 * ctx_lens: [B]                  int64 keys visible to the row's query (its position + 1)
 * out:      [B, H, D]            float32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256
#define MAX_BS 256

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *tables, *ctx_lens;
    int64_t max_blocks, B, H, KV, D, bs, window;
    float scale;
    float *out;
} job_t;

static void run_item(const job_t *j, int64_t item) {
    const int64_t b = item / j->KV, kv = item % j->KV;
    const int64_t G = j->H / j->KV, D = j->D, bs = j->bs, KV = j->KV;
    const int64_t ctx = j->ctx_lens[b];
    const int64_t start = (j->window > 0 && ctx > j->window) ? ctx - j->window : 0;
    const float *q = j->q + (b * j->H + kv * G) * D;       /* G consecutive heads */
    float acc[MAX_G][MAX_D];
    float m[MAX_G], l[MAX_G], s[MAX_G][MAX_BS];
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        memset(acc[g], 0, sizeof(float) * D);
    }
    for (int64_t t0 = start - start % bs; t0 < ctx; t0 += bs) {
        const int64_t block = j->tables[b * j->max_blocks + t0 / bs];
        const int64_t lo = t0 < start ? start - t0 : 0;
        const int64_t hi = (ctx - t0) < bs ? (ctx - t0) : bs;
        const float *kb = j->k_cache + (block * bs * KV + kv) * D;
        const float *vb = j->v_cache + (block * bs * KV + kv) * D;
        /* Scores for every query head sharing this kv head; each key row is loaded once for all G. */
        for (int64_t t = lo; t < hi; t++) {
            const float *kt = kb + t * KV * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + g * D;
                float dot = 0.f;
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kt[d];
                s[g][t] = dot * j->scale;
            }
        }
        /* Online softmax: rescale what was summed so far to the new running maximum. */
        for (int64_t g = 0; g < G; g++) {
            float bmax = m[g];
            for (int64_t t = lo; t < hi; t++) bmax = s[g][t] > bmax ? s[g][t] : bmax;
            const float correction = expf(m[g] - bmax);
            l[g] *= correction;
            for (int64_t d = 0; d < D; d++) acc[g][d] *= correction;
            for (int64_t t = lo; t < hi; t++) {
                s[g][t] = expf(s[g][t] - bmax);
                l[g] += s[g][t];
            }
            m[g] = bmax;
        }
        for (int64_t t = lo; t < hi; t++) {
            const float *vt = vb + t * KV * D;
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g][t];
                for (int64_t d = 0; d < D; d++) acc[g][d] += p * vt[d];
            }
        }
    }
    float *o = j->out + (b * j->H + kv * G) * D;
    for (int64_t g = 0; g < G; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g][d] * inv;
    }
}

/* Returns 0 on success, -1 if a shape exceeds the fixed per-item buffers.
 * Threads come from OpenMP: loaded after torch, this library binds to torch's own libgomp, so the
 * kernel runs on torch's thread pool instead of competing with its spinning workers. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *tables, int64_t max_blocks, const int64_t *ctx_lens,
                     int64_t B, int64_t H, int64_t KV, int64_t D, int64_t bs, int64_t window,
                     float scale, float *out, int64_t num_threads) {
    if (H % KV != 0 || H / KV > MAX_G || D > MAX_D || bs > MAX_BS) return -1;
    const job_t job = {q, k_cache, v_cache, tables, ctx_lens, max_blocks, B, H, KV, D, bs, window, scale, out};
    const int64_t items = B * KV;
    if (num_threads > items) num_threads = items;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < items; item++) run_item(&job, item);
    return 0;
}
