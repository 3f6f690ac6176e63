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
 *             vector), v_cache [num_blocks, bs, KV, D], both float32, bfloat16 or float16 (kv_fmt), or
 *             int8 codes with a float16 scale per (token, kv head) after each block's codes ([KV, bs] for
 *             keys, [bs, KV] for values; blocks i8_block_bytes apart): the scores are integer dots of the
 *             key codes with int16 query codes (attention_i8.c) times the scales; a value's scale multiplies
 *             its softmax weight, so the value codes are read as they lie
 * tables:     [rows, max_blocks] int64 block ids;  rows[i]: query i's row in tables
 * ctx_lens:   [n] int64 keys visible to query i (its position + 1)
 * tile_start: [tiles + 1] int64: tile j holds queries tile_start[j] .. tile_start[j + 1] - 1
 * out:        query i's heads at out + tokens[i] * ldo
 * Every sum runs in float32 in a fixed order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "kernels.h"
#include "pool.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_QG 64   /* queries x heads per tile */
#define MAX_D 256
#define MAX_BS 256

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *tables, *rows, *ctx_lens, *tokens, *tile_start;
    int64_t ldq, ldo, max_blocks, H, KV, D, bs, window;
    float scale;
    void *out;
    int act_fmt, kv_fmt;   /* q and out; the caches (half.h's formats) */
} job_t;

/* Vectors of the CPU's native width (16 lanes with AVX-512, 8 with AVX2, 4 otherwise): wider gcc
 * vectors than the registers are kept in memory. Lanes never mix, so each lane's arithmetic is the
 * same whatever the width. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef int8_t vb __attribute__((vector_size(VW)));
#define KC 16            /* keys per chunk */
#define NV (KC / VW)     /* vectors per chunk of keys */
#define QU 4             /* queries whose score sums run interleaved (independent chains) */
_Static_assert(KC == 16, "attention_i8.c scores 16 keys at a time");

static inline vf load_v(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* float16 vectors widened as they load (F16C), so a float16 cache is read in place like a float32 one. */
#if defined(__F16C__) && (VW == 8 || (VW == 16 && defined(__AVX512F__)))
#define HAVE_LOAD_VH 1
static inline vf load_vh(const uint16_t *p) {
#if VW == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
}
#else
#define HAVE_LOAD_VH 0
static inline vf load_vh(const uint16_t *p) { (void)p; return (vf){0}; }
#endif

/* int8 codes widened as they load (exact: every code is a float); gcc lowers a generic int8 -> int32
 * vector conversion to one byte at a time, so x86 spells it out. */
static inline vf load_vq(const int8_t *p) {
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

static inline vf splat(float x) { return x - (vf){0}; }

static inline vf select_v(vi mask, vf a, vf b) {   /* mask lanes -1: a, 0: b */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp(x) for x <= 0 in plain lane arithmetic: 2^n * e^r with a degree-6 Taylor polynomial on
 * |r| <= ln2/2, about 1 ulp; below -87 it is ~1e-38 (callers zero the lanes that must be 0). */
static inline vf exp_neg(vf x) {
    x = select_v(x < splat(-87.f), splat(-87.f), x);
    x = select_v(x > splat(0.f), splat(0.f), x);
    const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);  /* truncating a negative rounds */
    const vf r = x - __builtin_convertvector(n, vf) * 0.693147181f;
    vf p = splat(1.f / 720.f);
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * (vf)((n + 127) << 23);
}

/* Keys are taken in chunks of up to KC, never across a block: a query's chunks depend only on its own
 * context, so its softmax is rescaled at the same points whatever tile or step it is computed in. */
static void run_item(const job_t *j, int64_t tile, int64_t kv, const int kv_fmt) {
    const int64_t first = j->tile_start[tile], nq = j->tile_start[tile + 1] - first;
    const int64_t G = j->H / j->KV, D = j->D, DV = j->D / VW, bs = j->bs, KV = j->KV;
    const int64_t A = nq * G, A_pad = (A + QU - 1) / QU * QU;
    const int64_t *table = j->tables + j->rows[first] * j->max_blocks;
    float q[MAX_QG + QU][MAX_D], kbuf[MAX_D][KC], vbuf[KC][MAX_D];
    vf acc[MAX_QG][MAX_D / VW], p[MAX_QG + QU][NV];
    float m[MAX_QG], l[MAX_QG];
    /* int8 caches: each query head's int16 codes and scales (attention_i8.c), and a chunk's keys paired */
    int16_t qc[MAX_QG + ATTN_I8_QPAD][MAX_D];
    float qd[MAX_QG][MAX_D / 16];
    uint8_t kt[MAX_D * 2 * KC];
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
            load_fmt(q[a], j->q, token * j->ldq + (kv * G + g) * D, D, j->act_fmt);
            m[a] = -INFINITY;
            l[a] = 0.f;
            for (int64_t c = 0; c < DV; c++) acc[a][c] = splat(0.f);
        }
    }
    for (int64_t a = A; a < A_pad; a++) memset(q[a], 0, sizeof(float) * D);
    if (kv_fmt == FMT_I8) {
        for (int64_t a = 0; a < A; a++) attn_i8_query(q[a], D, qc[a], qd[a]);
        const int64_t padded = (A + ATTN_I8_QPAD - 1) / ATTN_I8_QPAD * ATTN_I8_QPAD;
        for (int64_t a = A; a < padded; a++) memset(qc[a], 0, sizeof qc[a]);
    }
    const int64_t chunk = bs < KC ? bs : KC;
    /* float16 keys and values are widened as they load when one pass over the tile's query heads
     * reads them (decode rows); a prompt chunk's tile reads them once per QU heads, so it widens
     * them once into the buffers instead. */
    const int in_place_f16 = HAVE_LOAD_VH && kv_fmt == FMT_F16 && A_pad <= QU;
    const int in_place_i8 = kv_fmt == FMT_I8 && A_pad <= QU;
    /* Elements from one block to the next; an int8 block's scales follow its codes. */
    const int64_t bstride = kv_fmt == FMT_I8 ? i8_block_bytes(bs, KV, D) : KV * D * bs;
    vi lane[NV];
    for (int u = 0; u < NV; u++)
        for (int k = 0; k < VW; k++) lane[u][k] = u * VW + k;
    for (int64_t c0 = lo_all - lo_all % chunk; c0 < hi_all; c0 += chunk) {
        const int64_t block = table[c0 / bs], off = c0 % bs;
        const int64_t n_keys = (hi_all - c0) < chunk ? (hi_all - c0) : chunk;
        /* The chunk's keys (lanes = keys) and values. float32 ones are read where they lie, except the
         * keys of a partial chunk, copied so that the lanes past n_keys are zeros, not whatever follows
         * in the block; 16-bit ones are widened once for the tile. */
        const int64_t kbase = block * bstride + kv * D * bs + off, vbase = block * bstride + kv * D + off * KV * D;
        /* The next chunk is another block, somewhere else: start fetching it, into L2 (prefetcht1).
         * Prefetches into L1 each hold one of its few miss buffers, so a core had ~24 lines in flight:
         * decode attention read the cache at 14 GB/s on Zen 4; into L2, 22-27 GB/s. */
        if (c0 + chunk < hi_all) {
            const int64_t nb = table[(c0 + chunk) / bs], noff = (c0 + chunk) % bs, E = fmt_size(kv_fmt);
            const char *nk = (const char *)j->k_cache + (nb * bstride + kv * D * bs + noff) * E;
            const char *nv = (const char *)j->v_cache + (nb * bstride + kv * D + noff * KV * D) * E;
            for (int64_t d = 0; d < D; d++) __builtin_prefetch(nk + d * bs * E, 0, 2);
            for (int64_t t = 0; t < chunk; t++)
                for (int64_t b = 0; b < D * E; b += 64) __builtin_prefetch(nv + t * KV * D * E + b, 0, 2);
        }
        const float *keys = &kbuf[0][0], *vals = &vbuf[0][0];
        const uint16_t *hkeys = 0, *hvals = 0;   /* float16 read in place */
        const int8_t *qvals = 0;                 /* int8 read in place */
        int64_t kstride = KC, vstride = MAX_D;
        /* int8: each key's scale times the softmax scale, each value's scale; 0 past n_keys. */
        float kscale[KC], vscale[KC];
        if (kv_fmt == FMT_I8) {
            const uint16_t *ks = (const uint16_t *)((const int8_t *)j->k_cache + block * bstride + KV * D * bs);
            const uint16_t *vs = (const uint16_t *)((const int8_t *)j->v_cache + block * bstride + KV * D * bs);
            for (int64_t t = 0; t < KC; t++) {
                kscale[t] = t < n_keys ? f16_to_f32(ks[kv * bs + off + t]) * j->scale : 0.f;
                vscale[t] = t < n_keys ? f16_to_f32(vs[(off + t) * KV + kv]) : 0.f;
            }
        }
        if (kv_fmt == FMT_F32 && n_keys == KC) {
            keys = (const float *)j->k_cache + kbase;
            kstride = bs;
        } else if (in_place_f16 && n_keys == KC) {
            hkeys = (const uint16_t *)j->k_cache + kbase;
            kstride = bs;
        } else if (kv_fmt == FMT_I8) {   /* regrouped once for the tile's query heads' integer dots */
            attn_i8_keys((const int8_t *)j->k_cache + kbase, bs, n_keys, D, kt);
        } else {
            for (int64_t d = 0; d < D; d++) {
                memset(kbuf[d], 0, sizeof kbuf[d]);
                load_fmt(kbuf[d], j->k_cache, kbase + d * bs, n_keys, kv_fmt);
            }
        }
        if (kv_fmt == FMT_F32) {
            vals = (const float *)j->v_cache + vbase;
            vstride = KV * D;
        } else if (in_place_f16) {
            hvals = (const uint16_t *)j->v_cache + vbase;
            vstride = KV * D;
        } else if (in_place_i8) {
            qvals = (const int8_t *)j->v_cache + vbase;
            vstride = KV * D;
        } else if (kv_fmt == FMT_I8) {
            for (int64_t t = 0; t < n_keys; t++)
                for (int64_t c = 0; c < DV; c++) {
                    const vf x = load_vq((const int8_t *)j->v_cache + vbase + t * KV * D + c * VW);
                    memcpy(vbuf[t] + c * VW, &x, sizeof x);
                }
        } else {
            for (int64_t t = 0; t < n_keys; t++) load_fmt(vbuf[t], j->v_cache, vbase + t * KV * D, D, kv_fmt);
        }
        /* Scores: each lane sums over d in order, one multiply-add chain per (query, key). */
        if (kv_fmt == FMT_I8) attn_i8_scores(kt, D, &qc[0][0], MAX_D, &qd[0][0], MAX_D / 16, A, kscale, (float *)p);
        for (int64_t a0 = 0; kv_fmt != FMT_I8 && a0 < A_pad; a0 += QU) {
            vf s[QU][NV];
#pragma GCC unroll 4
            for (int r = 0; r < QU; r++)
#pragma GCC unroll 4
                for (int u = 0; u < NV; u++) s[r][u] = splat(0.f);
            for (int64_t d = 0; d < D; d++) {
                vf kd[NV];
#pragma GCC unroll 4
                for (int u = 0; u < NV; u++)
                    kd[u] = hkeys ? load_vh(hkeys + d * kstride + u * VW) : load_v(keys + d * kstride + u * VW);
#pragma GCC unroll 4
                for (int r = 0; r < QU; r++) {
                    const vf x = splat(q[a0 + r][d]);
#pragma GCC unroll 4
                    for (int u = 0; u < NV; u++) s[r][u] += x * kd[u];
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < QU; r++)
#pragma GCC unroll 4
                for (int u = 0; u < NV; u++) p[a0 + r][u] = s[r][u] * j->scale;
        }
        /* Online softmax over the keys of this chunk each query sees, then its weighted values. */
        for (int64_t i = 0; i < nq; i++) {
            const int64_t lo = c0 < start[i] ? start[i] - c0 : 0;
            const int64_t hi = (ctx[i] - c0) < n_keys ? (ctx[i] - c0) : n_keys;
            if (lo >= hi) continue;
            for (int64_t g = 0; g < G; g++) {
                const int64_t a = i * G + g;
                float scores[KC], e[KC];
                memcpy(scores, p[a], sizeof scores);
                float bmax = m[a];
                for (int64_t t = lo; t < hi; t++) bmax = scores[t] > bmax ? scores[t] : bmax;
                const float correction = m[a] == -INFINITY ? 0.f : exp_neg(splat(m[a] - bmax))[0];
#pragma GCC unroll 4
                for (int u = 0; u < NV; u++) {
                    const vi seen = (lane[u] >= (int32_t)lo) & (lane[u] < (int32_t)hi);
                    const vf ev = select_v(seen, exp_neg(p[a][u] - bmax), splat(0.f));
                    memcpy(e + u * VW, &ev, sizeof ev);
                }
                float sum = 0.f;
                for (int k = 0; k < KC; k++) sum += e[k];
                l[a] = l[a] * correction + sum;
                m[a] = bmax;
                if (kv_fmt == FMT_I8)   /* the values' scales, folded into their weights once summed */
                    for (int k = 0; k < KC; k++) e[k] *= vscale[k];
                /* Four output vectors at a time stay in registers while the keys' values stream past. */
                int64_t c = 0;
                for (; c + 4 <= DV; c += 4) {
                    vf o[4];
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) o[u] = acc[a][c + u] * correction;
                    if (hvals)
                        for (int64_t t = lo; t < hi; t++) {
                            const vf w = splat(e[t]);
                            const uint16_t *vt = hvals + t * vstride + c * VW;
#pragma GCC unroll 4
                            for (int u = 0; u < 4; u++) o[u] += w * load_vh(vt + u * VW);
                        }
                    else if (qvals)
                        for (int64_t t = lo; t < hi; t++) {
                            const vf w = splat(e[t]);
                            const int8_t *vt = qvals + t * vstride + c * VW;
#pragma GCC unroll 4
                            for (int u = 0; u < 4; u++) o[u] += w * load_vq(vt + u * VW);
                        }
                    else
                        for (int64_t t = lo; t < hi; t++) {
                            const vf w = splat(e[t]);
                            const float *vt = vals + t * vstride + c * VW;
#pragma GCC unroll 4
                            for (int u = 0; u < 4; u++) o[u] += w * load_v(vt + u * VW);
                        }
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) acc[a][c + u] = o[u];
                }
                for (; c < DV; c++) {
                    vf o = acc[a][c] * correction;
                    for (int64_t t = lo; t < hi; t++)
                        o += e[t] * (hvals ? load_vh(hvals + t * vstride + c * VW)
                                     : qvals ? load_vq(qvals + t * vstride + c * VW) : load_v(vals + t * vstride + c * VW));
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
            store_fmt(j->out, j->tokens[first + i] * j->ldo + (kv * G + g) * D, (const float *)acc[a], D, j->act_fmt);
        }
}

/* The most queries a tile may hold for this model and block size (0: a shape the buffers cannot take). */
int64_t attention_tile_size(int64_t H, int64_t KV, int64_t D, int64_t bs) {
    if (KV < 1 || H % KV != 0 || H / KV > MAX_QG || D > MAX_D || D % KC || bs > MAX_BS) return 0;
    const int64_t qt = MAX_QG / (H / KV);
    return qt > 16 ? 16 : qt;
}

static void attention_item(void *arg, int64_t item) {
    const job_t *job = arg;
    /* A constant format per call: the float32 one keeps its in-place reads free of format tests. */
    if (job->kv_fmt == FMT_F32) run_item(job, item / job->KV, item % job->KV, FMT_F32);
    else if (job->kv_fmt == FMT_F16) run_item(job, item / job->KV, item % job->KV, FMT_F16);
    else if (job->kv_fmt == FMT_I8) run_item(job, item / job->KV, item % job->KV, FMT_I8);
    else run_item(job, item / job->KV, item % job->KV, FMT_BF16);
}

/* Returns 0 on success, -1 if a shape exceeds the fixed per-item buffers. */
int paged_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache, const int64_t *tables,
                    int64_t max_blocks, const int64_t *rows, const int64_t *ctx_lens, const int64_t *tokens,
                    const int64_t *tile_start, int64_t tiles, int64_t H, int64_t KV, int64_t D, int64_t bs,
                    int64_t window, float scale, void *out, int64_t ldo, int64_t num_threads, int act_fmt,
                    int kv_fmt) {
    const int64_t qt = attention_tile_size(H, KV, D, bs);
    if (qt == 0 || (act_fmt != FMT_F32 && act_fmt != FMT_BF16) || kv_fmt < FMT_F32 || kv_fmt > FMT_I8) return -1;
    for (int64_t t = 0; t < tiles; t++)
        if (tile_start[t + 1] - tile_start[t] > qt || tile_start[t + 1] <= tile_start[t]) return -1;
    job_t job = {q, k_cache, v_cache, tables, rows, ctx_lens, tokens, tile_start, ldq, ldo, max_blocks,
                 H, KV, D, bs, window, scale, out, act_fmt, kv_fmt};
    pool_for(tiles * KV, attention_item, &job, num_threads);
    return 0;
}
