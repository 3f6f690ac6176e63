/* The elementwise parts of a decoder layer, each one pass over memory instead of a chain of torch ops.
 *
 * rmsnorm:     y = w * x / sqrt(mean(x^2) + eps), row by row.
 * gated_act:   the gated activation of a SwiGLU (silu) or GeGLU (gelu, tanh form) MLP.
 * rope_cache:  rotate the q and k heads of a packed qkv buffer in place (rotate-half RoPE), after an
 *              RMSNorm of each head where the model has one, and write each token's k and v heads
 *              into the paged cache at its slot (the cache in float32, bfloat16 or float16).
 * add_rows:    x += y, for a residual added after a norm.
 * Activations are float32 or bfloat16 (is_bf16); bfloat16 is widened on load and rounded to nearest
 * even on store, with every step in float32 between. Each row is computed alone, so results never
 * depend on the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define MAX_D 256

static inline float load(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }   /* nearest even */

static inline void store(void *base, int64_t i, float f, int is_bf16) {
    store_one(base, i, f, is_bf16 ? FMT_BF16 : FMT_F32);
}

/* bfloat16 follows Hugging Face's order: normalise in float32, round to bf16, then scale by w. */
static inline __attribute__((always_inline)) void rmsnorm_row(const void *x, const void *w, void *y, int64_t N,
                                                              float eps, const int IS_BF16) {
    float sum = 0.f;
    for (int64_t i = 0; i < N; i++) {
        const float v = load(x, i, IS_BF16);
        sum += v * v;
    }
    const float r = 1.f / sqrtf(sum / (float)N + eps);
    for (int64_t i = 0; i < N; i++) {
        float v = load(x, i, IS_BF16) * r;
        if (IS_BF16) v = round_bf16(v);
        store(y, i, v * load(w, i, IS_BF16), IS_BF16);
    }
}

typedef struct {
    const void *x, *w;
    void *y;
    int64_t ldx, ldy, N;
    float eps;
    int is_bf16;
} rmsnorm_job;

static void rmsnorm_item(void *arg, int64_t m) {
    const rmsnorm_job *j = arg;
    const int64_t size = j->is_bf16 ? 2 : 4;
    const char *xr = (const char *)j->x + m * j->ldx * size;
    char *yr = (char *)j->y + m * j->ldy * size;
    if (j->is_bf16) rmsnorm_row(xr, j->w, yr, j->N, j->eps, 1);
    else rmsnorm_row(xr, j->w, yr, j->N, j->eps, 0);
}

void rmsnorm(const void *x, int64_t ldx, const void *w, void *y, int64_t ldy, int64_t M, int64_t N, float eps,
             int is_bf16, int64_t num_threads) {
    if (M * N < 16384) num_threads = 1;   /* a decode step's rows cost less than waking a thread */
    rmsnorm_job job = {x, w, y, ldx, ldy, N, eps, is_bf16};
    pool_for(M, rmsnorm_item, &job, num_threads);
}

/* qkv: T rows of (Hq + 2 Hkv) heads of D values, row stride ld. The leading R values of each q and k
 * head turn (R = D but for partial RoPE, as Phi-3's), the rest pass unchanged. cos, sin: [T, R]
 * float32, sin signed so that rotate_half(x) * sin == roll(x, R/2) * sin; or, with pos, tables of
 * `rows` rows of which token t turns with row pos[t] (its position). q_norm, k_norm: per-head
 * RMSNorm weights applied before the rotation (NULL: none; Gemma's order: normalise and scale in
 * float32, round once). Caches in the activations' dtype, slot = block * bs + offset: keys
 * [blocks, Hkv, D, bs] (transposed, as the attention kernel reads them), values [blocks, bs, Hkv, D]; an int8
 * cache gets each head's vector quantized alone, codes and scale (half.h's quantize_i8). */
typedef struct {
    void *qkv, *k_cache, *v_cache;
    const float *cos, *sin;
    const int64_t *pos, *slots;
    const void *q_norm, *k_norm;
    int64_t ld, Hq, Hkv, D, R, bs;
    float eps;
    int is_bf16, kv_fmt;
} rope_job;

/* One head's key (transposed: codes [Hkv, D, bs], scales [Hkv, bs]) or value (codes [bs, Hkv, D], scales
 * [bs, Hkv]) vector x into an int8 cache block (half.h's i8_block_bytes apart), quantized alone. */
static void store_i8(void *cache, const float *x, int64_t slot, int64_t h, int64_t Hkv, int64_t D, int64_t bs,
                     int transposed) {
    int8_t codes[MAX_D];
    const uint16_t scale = quantize_i8(x, D, codes);
    int8_t *block = (int8_t *)cache + (slot / bs) * i8_block_bytes(bs, Hkv, D);
    uint16_t *scales = (uint16_t *)(block + bs * Hkv * D);
    const int64_t off = slot % bs;
    if (transposed) {
        for (int64_t d = 0; d < D; d++) block[(h * D + d) * bs + off] = codes[d];
        scales[h * bs + off] = scale;
    } else {
        memcpy(block + (off * Hkv + h) * D, codes, D);
        scales[off * Hkv + h] = scale;
    }
}

static void rope_item(void *arg, int64_t t) {
    const rope_job *j = arg;
    void *qkv = j->qkv, *k_cache = j->k_cache, *v_cache = j->v_cache;
    const int64_t D = j->D, R = j->R, Hq = j->Hq, Hkv = j->Hkv, bs = j->bs, half = R / 2, heads = Hq + Hkv;
    const int64_t slot = j->slots[t];
    const int is_bf16 = j->is_bf16;
    const int64_t turn = j->pos ? j->pos[t] : t;
    const float *c = j->cos + turn * R, *s = j->sin + turn * R;
    const int64_t row = t * j->ld;
    for (int64_t h = 0; h < heads; h++) {
        float x[MAX_D];
        const int64_t base = row + h * D;
        for (int64_t d = 0; d < D; d++) x[d] = load(qkv, base + d, is_bf16);
        const void *norm = h < Hq ? j->q_norm : j->k_norm;
        if (norm) {
            float sum = 0.f;
            for (int64_t d = 0; d < D; d++) sum += x[d] * x[d];
            const float r = 1.f / sqrtf(sum / (float)D + j->eps);
            for (int64_t d = 0; d < D; d++) x[d] = x[d] * r * load(norm, d, is_bf16);
            if (is_bf16)
                for (int64_t d = 0; d < D; d++) x[d] = round_bf16(x[d]);
        }
        float y[MAX_D];
        for (int64_t d = 0; d < R; d++) y[d] = x[d] * c[d] + x[d < half ? d + half : d - half] * s[d];
        for (int64_t d = R; d < D; d++) y[d] = x[d];
        const int to_i8 = h >= Hq && j->kv_fmt == FMT_I8;
        for (int64_t d = 0; d < D; d++) {
            store(qkv, base + d, y[d], is_bf16);
            if (to_i8) y[d] = is_bf16 ? round_bf16(y[d]) : y[d];
            else if (h >= Hq)   /* what q's dtype holds, then narrowed to the cache's */
                store_one(k_cache, (((slot / bs) * Hkv + (h - Hq)) * D + d) * bs + slot % bs,
                          is_bf16 ? round_bf16(y[d]) : y[d], j->kv_fmt);
        }
        if (to_i8) store_i8(k_cache, y, slot, h - Hq, Hkv, D, bs, 1);
    }
    for (int64_t h = 0; h < Hkv; h++) {
        const int64_t src = row + (heads + h) * D, dst = (slot * Hkv + h) * D;
        float v[MAX_D];
        load_fmt(v, qkv, src, D, is_bf16 ? FMT_BF16 : FMT_F32);
        if (j->kv_fmt == FMT_I8) store_i8(v_cache, v, slot, h, Hkv, D, bs, 0);
        else store_fmt(v_cache, dst, v, D, j->kv_fmt);
    }
}

int rope_cache(void *qkv, int64_t ld, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t R, const float *cos,
               const float *sin, const int64_t *pos, int64_t rows, const int64_t *slots, void *k_cache,
               void *v_cache, int64_t bs, const void *q_norm, const void *k_norm, float eps, int is_bf16, int kv_fmt,
               int64_t num_threads) {
    if (D > MAX_D || R > D || R < 2 || R % 2 || kv_fmt < FMT_F32 || kv_fmt > FMT_I8) return -1;
    for (int64_t t = 0; pos && t < T; t++)
        if (pos[t] < 0 || pos[t] >= rows) return -1;
    if (T * (Hq + Hkv) * D < 65536) num_threads = 1;
    rope_job job = {qkv, k_cache, v_cache, cos, sin, pos, slots, q_norm, k_norm, ld, Hq, Hkv, D, R, bs, eps,
                    is_bf16, kv_fmt};
    pool_for(T, rope_item, &job, num_threads);
    return 0;
}

void add_rows(void *x, const void *y, int64_t n, int is_bf16) {
    if (!is_bf16) {
        float *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) store(x, i, load(x, i, 1) + load(y, i, 1), 1);
}

/* e^x in plain arithmetic (no libm call, so the loops over it vectorise): 2^n * e^r with |r| <= ln2/2
 * and a degree-6 Taylor polynomial, about 1 ulp; x is clamped to [-87, 88]. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693147181f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* The gated MLP's middle: y[m, i] = act(x[m, i]) * x[m, I + i] over a fused gate/up product, act silu
 * (act 0) or gelu in its tanh form (act 1): gelu_tanh(g) = g * (1 + tanh(u)) / 2 = g * sigmoid(2u),
 * u = sqrt(2/pi) (g + 0.044715 g^3), so both are g / (1 + e^-z). In bfloat16 the activation is rounded
 * before the product, as two separate bf16 ops would round. */
typedef struct {
    const void *x;
    void *y;
    int64_t ldx, ldy, I, act;
    int is_bf16;
} gated_job;

static inline float gate_arg(float g, int64_t act) {   /* z of g / (1 + e^-z) */
    return act ? 1.5957691216f * (g + 0.044715f * g * g * g) : g;
}

static void gated_item(void *arg, int64_t m) {
    const gated_job *j = arg;
    const int64_t xr = m * j->ldx, yr = m * j->ldy, I = j->I, act = j->act;
    if (!j->is_bf16) {
        const float *gate = (const float *)j->x + xr, *up = gate + I;
        float *out = (float *)j->y + yr;
        if (act)
            for (int64_t i = 0; i < I; i++) out[i] = gate[i] / (1.f + exp_approx(-gate_arg(gate[i], 1))) * up[i];
        else
            for (int64_t i = 0; i < I; i++) out[i] = gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
        return;
    }
    for (int64_t i = 0; i < I; i++) {
        const float g = load(j->x, xr + i, 1), u = load(j->x, xr + I + i, 1);
        store(j->y, yr + i, round_bf16(g / (1.f + exp_approx(-gate_arg(g, act)))) * u, 1);
    }
}

void gated_act(const void *x, int64_t ldx, void *y, int64_t ldy, int64_t M, int64_t I, int64_t act, int is_bf16,
               int64_t num_threads) {
    if (M * I < 65536) num_threads = 1;
    gated_job job = {x, y, ldx, ldy, I, act, is_bf16};
    pool_for(M, gated_item, &job, num_threads);
}

/* dst = src converted between element formats, n elements (widened, then narrowed to nearest even). */
void convert_fmt(const void *src, int src_fmt, void *dst, int dst_fmt, int64_t n) {
    float buf[256];
    for (int64_t i = 0; i < n; i += 256) {
        const int64_t m = n - i < 256 ? n - i : 256;
        load_fmt(buf, src, i, m, src_fmt);
        store_fmt(dst, i, buf, m, dst_fmt);
    }
}
