/* Decode attention over a paged KV cache: one query token per row, fused gather + softmax + sum.
 *
 * Reads each key and value of a row's context exactly once (torch would gather the blocks into a
 * padded copy first, then read that copy again). Work items are (row, kv head) pairs; each handles
 * the G = H / KV query heads that share a kv head, so GQA costs no extra memory traffic.
 *
 * q:        row b's heads at q + tokens[b] * ldq, [H, D] contiguous   (float32 or bfloat16)
 * k_cache:  [num_blocks, bs, KV, D] (v_cache the same), the activations' dtype
 * tables:   [B, max_blocks] int64 block ids
 * ctx_lens: [B] int64 keys visible to the row's query (its position + 1)
 * out:      row b's heads at out + tokens[b] * ldo, [H, D]
 * tokens:   [B] int64 packed token index of each row, or NULL for 0..B-1
 * Every sum runs in float32 in a fixed order, so a row's result does not depend on its batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256
#define MAX_BS 256
#define LANES 16   /* partial sums per dot product: one AVX-512 vector, two AVX2 ones */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *tables, *ctx_lens, *tokens;
    int64_t ldq, ldo, max_blocks, B, H, KV, D, bs, window;
    float scale;
    void *out;
} job_t;

static inline void load_row(float *dst, const void *base, int64_t offset, int64_t n, int is_bf16) {
    if (!is_bf16) {
        memcpy(dst, (const float *)base + offset, n * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)base + offset;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, 4);
    }
}

static inline void store_row(void *base, int64_t offset, const float *src, int64_t n, int is_bf16) {
    if (!is_bf16) {
        memcpy((float *)base + offset, src, n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)base + offset;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, src + i, 4);
        if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x400000u;
        else bits += 0x7fffu + ((bits >> 16) & 1u);
        dst[i] = (uint16_t)(bits >> 16);
    }
}

/* Dot product in LANES interleaved partial sums (vectorisable without reassociating), then a fixed tree. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) part[i] += a[d + i] * b[d + i];
    for (int i = 0; d < n; d++, i++) part[i] += a[d] * b[d];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) part[i] += part[i + w];
    return part[0];
}

static void run_item(const job_t *j, int64_t item, int is_bf16) {
    const int64_t b = item / j->KV, kv = item % j->KV;
    const int64_t G = j->H / j->KV, D = j->D, bs = j->bs, KV = j->KV;
    const int64_t ctx = j->ctx_lens[b], token = j->tokens ? j->tokens[b] : b;
    const int64_t start = (j->window > 0 && ctx > j->window) ? ctx - j->window : 0;
    float q[MAX_G][MAX_D], acc[MAX_G][MAX_D], kt[MAX_D], vt[MAX_D];
    float m[MAX_G], l[MAX_G], s[MAX_G][MAX_BS];
    for (int64_t g = 0; g < G; g++) {
        load_row(q[g], j->q, token * j->ldq + (kv * G + g) * D, D, is_bf16);
        m[g] = -INFINITY;
        l[g] = 0.f;
        memset(acc[g], 0, sizeof(float) * D);
    }
    for (int64_t t0 = start - start % bs; t0 < ctx; t0 += bs) {
        const int64_t block = j->tables[b * j->max_blocks + t0 / bs];
        const int64_t lo = t0 < start ? start - t0 : 0;
        const int64_t hi = (ctx - t0) < bs ? (ctx - t0) : bs;
        const int64_t base = (block * bs * KV + kv) * D;
        /* Scores for every query head sharing this kv head; each key row is loaded once for all G. */
        for (int64_t t = lo; t < hi; t++) {
            load_row(kt, j->k_cache, base + t * KV * D, D, is_bf16);
            for (int64_t g = 0; g < G; g++) s[g][t] = dot(q[g], kt, D) * j->scale;
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
            load_row(vt, j->v_cache, base + t * KV * D, D, is_bf16);
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g][t];
                for (int64_t d = 0; d < D; d++) acc[g][d] += p * vt[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; d++) acc[g][d] *= inv;
        store_row(j->out, token * j->ldo + (kv * G + g) * D, acc[g], D, is_bf16);
    }
}

/* Returns 0 on success, -1 if a shape exceeds the fixed per-item buffers.
 * Threads come from OpenMP: loaded after torch, this library binds to torch's own libgomp, so the
 * kernel runs on torch's thread pool instead of competing with its spinning workers. */
int paged_decode(const void *q, int64_t ldq, const void *k_cache, const void *v_cache, const int64_t *tables,
                 int64_t max_blocks, const int64_t *ctx_lens, const int64_t *tokens, int64_t B, int64_t H,
                 int64_t KV, int64_t D, int64_t bs, int64_t window, float scale, void *out, int64_t ldo,
                 int64_t num_threads, int is_bf16) {
    if (H % KV != 0 || H / KV > MAX_G || D > MAX_D || bs > MAX_BS) return -1;
    const job_t job = {q, k_cache, v_cache, tables, ctx_lens, tokens, ldq, ldo, max_blocks, B, H, KV, D, bs,
                       window, scale, out};
    const int64_t items = B * KV;
    if (num_threads > items) num_threads = items;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        if (is_bf16) run_item(&job, item, 1);
        else run_item(&job, item, 0);
    }
    return 0;
}
