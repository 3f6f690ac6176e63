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
 * k_cache:    [num_blocks, KV, D, bs] (keys transposed in each block: 16 keys' d-th values load as one
 *             vector), v_cache [num_blocks, bs, KV, D], both in q's dtype
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

/* Sixteen lanes as one value: gcc maps it to one AVX-512 register, two AVX2 ones, or four SSE ones.
 * Lanes never mix, so each lane's arithmetic is the same whatever the vector width. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define KC 16       /* keys per chunk: one v16 of scores */
#define QU 4        /* query vectors whose score sums run interleaved (independent chains) */

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 select16(v16i mask, v16 a, v16 b) {   /* mask lanes -1: a, 0: b */
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* exp(x) for x <= 0 in plain lane arithmetic: 2^n * e^r with a degree-6 Taylor polynomial on
 * |r| <= ln2/2, about 1 ulp; below -87 it is ~1e-38 (callers zero the lanes that must be 0). */
static inline v16 exp_neg(v16 x) {
    x = select16(x < splat(-87.f), splat(-87.f), x);
    x = select16(x > splat(0.f), splat(0.f), x);
    const v16i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v16i);  /* truncating a negative rounds */
    const v16 r = x - __builtin_convertvector(n, v16) * 0.693147181f;
    v16 p = splat(1.f / 720.f);
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * (v16)((n + 127) << 23);
}

/* Keys are taken in chunks of up to KC, never across a block: a query's chunks depend only on its own
 * context, so its softmax is rescaled at the same points whatever tile or step it is computed in. */
static void run_item(const job_t *j, int64_t tile, int64_t kv, int is_bf16) {
    const int64_t first = j->tile_start[tile], nq = j->tile_start[tile + 1] - first;
    const int64_t G = j->H / j->KV, D = j->D, DV = j->D / KC, bs = j->bs, KV = j->KV;
    const int64_t A = nq * G, A_pad = (A + QU - 1) / QU * QU;
    const int64_t *table = j->tables + j->rows[first] * j->max_blocks;
    float q[MAX_QG + QU][MAX_D];
    v16 acc[MAX_QG][MAX_D / KC], kT[MAX_D], vf[KC][MAX_D / KC], p[MAX_QG + QU];
    float m[MAX_QG], l[MAX_QG];
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
            for (int64_t c = 0; c < DV; c++) acc[a][c] = splat(0.f);
        }
    }
    for (int64_t a = A; a < A_pad; a++) memset(q[a], 0, sizeof(float) * D);
    const int64_t chunk = bs < KC ? bs : KC;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t c0 = lo_all - lo_all % chunk; c0 < hi_all; c0 += chunk) {
        const int64_t block = table[c0 / bs], off = c0 % bs;
        const int64_t n_keys = (hi_all - c0) < chunk ? (hi_all - c0) : chunk;
        /* The chunk's keys (lanes = keys; lanes past n_keys zero) and values, widened once for the tile. */
        const int64_t kbase = (block * KV + kv) * D * bs + off, vbase = (block * bs * KV + kv) * D + off * KV * D;
        for (int64_t d = 0; d < D; d++) {
            kT[d] = splat(0.f);
            load_row((float *)&kT[d], j->k_cache, kbase + d * bs, n_keys, is_bf16);
        }
        for (int64_t t = 0; t < n_keys; t++) load_row((float *)vf[t], j->v_cache, vbase + t * KV * D, D, is_bf16);
        /* Scores: each lane sums over d in order, one multiply-add chain per (query, key). */
        for (int64_t a0 = 0; a0 < A_pad; a0 += QU) {
            v16 s0 = splat(0.f), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t d = 0; d < D; d++) {
                s0 += q[a0][d] * kT[d];
                s1 += q[a0 + 1][d] * kT[d];
                s2 += q[a0 + 2][d] * kT[d];
                s3 += q[a0 + 3][d] * kT[d];
            }
            p[a0] = s0 * j->scale;
            p[a0 + 1] = s1 * j->scale;
            p[a0 + 2] = s2 * j->scale;
            p[a0 + 3] = s3 * j->scale;
        }
        /* Online softmax over the keys of this chunk each query sees, then its weighted values. */
        for (int64_t i = 0; i < nq; i++) {
            const int64_t lo = c0 < start[i] ? start[i] - c0 : 0;
            const int64_t hi = (ctx[i] - c0) < n_keys ? (ctx[i] - c0) : n_keys;
            if (lo >= hi) continue;
            const v16i seen = (lane >= (int32_t)lo) & (lane < (int32_t)hi);
            for (int64_t g = 0; g < G; g++) {
                const int64_t a = i * G + g;
                float bmax = m[a];
                for (int64_t t = lo; t < hi; t++) bmax = p[a][t] > bmax ? p[a][t] : bmax;
                const float correction = m[a] == -INFINITY ? 0.f : exp_neg(splat(m[a] - bmax))[0];
                const v16 e = select16(seen, exp_neg(p[a] - bmax), splat(0.f));
                float sum = 0.f;
                for (int k = 0; k < KC; k++) sum += e[k];
                l[a] = l[a] * correction + sum;
                m[a] = bmax;
                for (int64_t c = 0; c < DV; c++) {
                    v16 o = acc[a][c] * correction;
                    for (int64_t t = lo; t < hi; t++) o += e[t] * vf[t][c];
                    acc[a][c] = o;
                }
            }
        }
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t a = i * G + g;
            const float inv = l[a] > 0.f ? 1.f / l[a] : 0.f;
            for (int64_t c = 0; c < DV; c++) acc[a][c] *= inv;
            store_row(j->out, j->tokens[first + i] * j->ldo + (kv * G + g) * D, (const float *)acc[a], D, is_bf16);
        }
}

/* The most queries a tile may hold for this model and block size (0: a shape the buffers cannot take). */
int64_t attention_tile_size(int64_t H, int64_t KV, int64_t D, int64_t bs) {
    if (KV < 1 || H % KV != 0 || H / KV > MAX_QG || D > MAX_D || D % KC || bs > MAX_BS) return 0;
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
