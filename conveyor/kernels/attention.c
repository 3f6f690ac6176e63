/* Attention over a paged KV cache for every query of a step (decode rows and prompt chunks alike).
 *
 * Each query attends to its own row's cached context up to its own position, computed the same way
 * whatever else is in the step: a token's result never depends on its batch, its chunk, or whether
 * its prompt prefix came from the prefix cache (one code path for all, so no two implementations
 * round differently). Keys and values are read straight from the cache blocks: no gather, no padding.
 *
 * Work items are (tile, kv head): a tile is up to QT consecutive queries of one row, which share each
 * loaded key and value; the G = H / KV query heads of a kv head share them too (GQA for free).
 *
 * q:          query i's heads at q + tokens[i] * ldq, [H, D] contiguous   (float32 or bfloat16)
 * caches:     [num_blocks, bs, KV, D] in the same dtype
 * tables:     [rows, max_blocks] int64 block ids;  rows[i]: query i's row in tables
 * ctx_lens:   [n] int64 keys visible to query i (its position + 1)
 * tile_start: [tiles + 1] int64: tile j holds queries tile_start[j] .. tile_start[j + 1] - 1
 * out:        query i's heads at out + tokens[i] * ldo
 * Every sum runs in float32 in a fixed order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_QG 64   /* queries x heads per tile */
#define MAX_D 256
#define MAX_BS 256
#define LANES 16    /* partial sums per dot product: one AVX-512 vector, two AVX2 ones */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *tables, *rows, *ctx_lens, *tokens, *tile_start;
    int64_t ldq, ldo, max_blocks, H, KV, D, bs, window;
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

static void run_item(const job_t *j, int64_t tile, int64_t kv, int is_bf16) {
    const int64_t first = j->tile_start[tile], nq = j->tile_start[tile + 1] - first;
    const int64_t G = j->H / j->KV, D = j->D, bs = j->bs, KV = j->KV;
    const int64_t *table = j->tables + j->rows[first] * j->max_blocks;
    float q[MAX_QG][MAX_D], acc[MAX_QG][MAX_D], kt[MAX_D], vt[MAX_D];
    float m[MAX_QG], l[MAX_QG], s[MAX_QG][MAX_BS];
    int64_t start[MAX_QG], ctx[MAX_QG];
    int64_t lo_all = INT64_MAX, hi_all = 0;
    for (int64_t i = 0; i < nq; i++) {
        const int64_t c = j->ctx_lens[first + i], token = j->tokens[first + i];
        ctx[i] = c;
        start[i] = (j->window > 0 && c > j->window) ? c - j->window : 0;
        lo_all = start[i] < lo_all ? start[i] : lo_all;
        hi_all = c > hi_all ? c : hi_all;
        for (int64_t g = 0; g < G; g++) {
            const int64_t a = i * G + g;
            load_row(q[a], j->q, token * j->ldq + (kv * G + g) * D, D, is_bf16);
            m[a] = -INFINITY;
            l[a] = 0.f;
            memset(acc[a], 0, sizeof(float) * D);
        }
    }
    for (int64_t t0 = lo_all - lo_all % bs; t0 < hi_all; t0 += bs) {
        const int64_t base = (table[t0 / bs] * bs * KV + kv) * D;
        const int64_t block_hi = (hi_all - t0) < bs ? (hi_all - t0) : bs;
        /* Scores: each key row is loaded once for every query and head of the tile that sees it. */
        for (int64_t t = 0; t < block_hi; t++) {
            load_row(kt, j->k_cache, base + t * KV * D, D, is_bf16);
            for (int64_t i = 0; i < nq; i++) {
                if (t0 + t < start[i] || t0 + t >= ctx[i]) continue;
                for (int64_t g = 0; g < G; g++) s[i * G + g][t] = dot(q[i * G + g], kt, D) * j->scale;
            }
        }
        /* Online softmax over the keys of this block each query sees: rescale to the new maximum. */
        for (int64_t i = 0; i < nq; i++) {
            const int64_t lo = t0 < start[i] ? start[i] - t0 : 0;
            const int64_t hi = (ctx[i] - t0) < bs ? (ctx[i] - t0) : bs;
            if (lo >= hi) continue;
            for (int64_t g = 0; g < G; g++) {
                const int64_t a = i * G + g;
                float bmax = m[a];
                for (int64_t t = lo; t < hi; t++) bmax = s[a][t] > bmax ? s[a][t] : bmax;
                const float correction = expf(m[a] - bmax);
                l[a] *= correction;
                for (int64_t d = 0; d < D; d++) acc[a][d] *= correction;
                for (int64_t t = lo; t < hi; t++) {
                    s[a][t] = expf(s[a][t] - bmax);
                    l[a] += s[a][t];
                }
                m[a] = bmax;
            }
        }
        for (int64_t t = 0; t < block_hi; t++) {
            load_row(vt, j->v_cache, base + t * KV * D, D, is_bf16);
            for (int64_t i = 0; i < nq; i++) {
                if (t0 + t < start[i] || t0 + t >= ctx[i]) continue;
                for (int64_t g = 0; g < G; g++) {
                    const float p = s[i * G + g][t];
                    float *acc_a = acc[i * G + g];
                    for (int64_t d = 0; d < D; d++) acc_a[d] += p * vt[d];
                }
            }
        }
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t a = i * G + g;
            const float inv = l[a] > 0.f ? 1.f / l[a] : 0.f;
            for (int64_t d = 0; d < D; d++) acc[a][d] *= inv;
            store_row(j->out, j->tokens[first + i] * j->ldo + (kv * G + g) * D, acc[a], D, is_bf16);
        }
}

/* The most queries a tile may hold for this model and block size (0: a shape the buffers cannot take). */
int64_t attention_tile_size(int64_t H, int64_t KV, int64_t D, int64_t bs) {
    if (KV < 1 || H % KV != 0 || H / KV > MAX_QG || D > MAX_D || bs > MAX_BS) return 0;
    const int64_t qt = MAX_QG / (H / KV);
    return qt > 16 ? 16 : qt;
}

/* Returns 0 on success, -1 if a shape exceeds the fixed per-item buffers.
 * Threads come from OpenMP: loaded after torch, this library binds to torch's own libgomp, so the
 * kernel runs on torch's thread pool instead of competing with its spinning workers. */
int paged_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache, const int64_t *tables,
                    int64_t max_blocks, const int64_t *rows, const int64_t *ctx_lens, const int64_t *tokens,
                    const int64_t *tile_start, int64_t tiles, int64_t H, int64_t KV, int64_t D, int64_t bs,
                    int64_t window, float scale, void *out, int64_t ldo, int64_t num_threads, int is_bf16) {
    const int64_t qt = attention_tile_size(H, KV, D, bs);
    if (qt == 0) return -1;
    for (int64_t t = 0; t < tiles; t++)
        if (tile_start[t + 1] - tile_start[t] > qt || tile_start[t + 1] <= tile_start[t]) return -1;
    const job_t job = {q, k_cache, v_cache, tables, rows, ctx_lens, tokens, tile_start, ldq, ldo, max_blocks,
                       H, KV, D, bs, window, scale, out};
    const int64_t items = tiles * KV;
    if (num_threads > items) num_threads = items;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        if (is_bf16) run_item(&job, item / KV, item % KV, 1);
        else run_item(&job, item / KV, item % KV, 0);
    }
    return 0;
}
