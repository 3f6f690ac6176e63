/* The linear layer that runs every quantized format as segments of one output (a fused q/k/v whose
 * parts differ in format quantizes its activations once per scheme), and the activations of
 * quant.c's formats and the 32-k ones of kquant_k.c (Q5_0, Q5_1, IQ4_NL): int8 per row and 32-k
 * block (d_x = amax / 127), with their sums. The kernels are quant.c's (Q8_0, Q4_0, Q4_1) and
 * kquant_k.c's (the rest; it quantizes the 256-k formats' activations itself); work items are
 * (block of MC rows, panel of 32 output channels), and a row's result never depends on which item
 * or thread computed it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MC 64   /* rows per work item: kquant_k.c's kq_panel_k takes at most 64 */
/* A segment this large streams from memory on every call (no last-level cache seen holds it): quant.c
 * prefetches its Q8_0 blocks ahead, which costs the layers a cache keeps between steps. */
#define STREAMED_LAYER_BYTES ((int64_t)64 << 20)

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------ activations */

typedef struct {
    int8_t *qx;        /* [M][K] */
    float *dx, *sxd;   /* [M][KB]: scale, scale * sum */
    int32_t *sx, *s16; /* [M][KB]: sum; the two 16-k half sums as int16 (lo | hi << 16) */
} acts;

/* One row: per 32-block scale d = amax / 127, codes q = round-to-nearest-even(x * 127 / amax), the
 * block's sum and its two 16-halves' sums. The AVX2 path gives the same bits as the scalar one. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, int32_t *s, float *sd, int32_t *s16) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        int32_t half[2] = {0, 0};
        float amax = 0.f;
#if KN_AVX2
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        amax = _mm_cvtss_f32(m4);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i c[4];
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        for (int h = 0; h < 2; h++) {
            __m256i t = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
            half[h] = _mm_cvtsi128_si32(t4);
        }
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back. */
        const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        _mm256_storeu_si256((__m256i *)(q + b * QK),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < QK; i++) {
            const int32_t v = (int32_t)nearbyintf(xb[i] * inv);
            q[b * QK + i] = (int8_t)v;
            half[i / 16] += v;
        }
#endif
        d[b] = amax / 127.f;
        s[b] = half[0] + half[1];
        sd[b] = d[b] * (float)s[b];
        s16[b] = (int32_t)(((uint32_t)half[0] & 0xffff) | ((uint32_t)half[1] << 16));
    }
}

/* The rows of x as the matmul quantizes them (for tests and references): q (M, K), d (M, K/32). */
int quant_activations(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *q, float *d) {
    if (K % QK) return -1;
    int32_t *s = malloc(sizeof(int32_t) * (K / QK) * 2);
    float *sd = malloc(sizeof(float) * (K / QK));
    if (!s || !sd) { free(s); free(sd); return -2; }
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, K, q + m * K, d + m * (K / QK), s, sd, s + K / QK);
    free(s);
    free(sd);
    return 0;
}

/* ------------------------------------------------------------------ the linear layer */

typedef struct {   /* kquant_k.c's activations: [M][K], [M][K/256], [M][K/32], [M][K/16] */
    int8_t *qx;
    float *du;
    int32_t *bs32, *o16;
} kacts;

typedef struct {
    const kq_linear_t *L;
    const float *x;
    int64_t ldx, ldy, M;
    float *y;
    acts a;
    kacts k;
    int has_k, has_other;
    int64_t first_item[KQ_MAX_SEGMENTS + 1], col[KQ_MAX_SEGMENTS], panels[KQ_MAX_SEGMENTS];
    int streamed[KQ_MAX_SEGMENTS];   /* the segment is STREAMED_LAYER_BYTES or more */
} linear_job;

static void quantize_item(void *arg, int64_t m) {
    const linear_job *j = arg;
    const int64_t K = j->L->k, KB = K / QK;
    if (j->has_other)
        quantize_row(j->x + m * j->ldx, K, j->a.qx + m * K, j->a.dx + m * KB, j->a.sx + m * KB, j->a.sxd + m * KB,
                     j->a.s16 + m * KB);
    if (j->has_k)
        kq_quantize_row_k(j->x + m * j->ldx, K, j->k.qx + m * K, j->k.du + m * (K / 256), j->k.bs32 + m * (K / 32),
                          j->k.o16 + m * (K / 16));
}

/* Items: per segment, (block of MC rows, panel), block-major. */
static void linear_item(void *arg, int64_t item) {
    const linear_job *j = arg;
    int s = 0;
    while (item >= j->first_item[s + 1]) s++;
    const kq_segment *seg = &j->L->seg[s];
    const int64_t local = item - j->first_item[s], panels = j->panels[s], K = j->L->k, KB = K / QK;
    const int64_t p = local % panels, m0 = (local / panels) * MC, m1 = min64(j->M, m0 + MC);
    const int64_t n0 = p * NR, nc = min64(NR, seg->n - n0);
    const float *bias = seg->bias ? seg->bias + n0 : 0;
    float *y = j->y + j->col[s] + n0;
    const int fmt = (int)seg->fmt;
    const uint8_t *wp = seg->w + p * (K / kn_unit_k(fmt)) * kn_unit_bytes(fmt);
    if (legacy_format(fmt)) {
        quant_panel_rows(fmt, wp, KB, j->a.qx + m0 * K, K, j->a.dx + m0 * KB, j->a.sx + m0 * KB,
                         j->a.sxd + m0 * KB, bias, y + m0 * j->ldy, j->ldy, nc, 0, m1 - m0, j->streamed[s]);
    } else if (acts256(fmt)) {
        kq_panel_k(fmt, wp, K, j->k.qx + m0 * K, j->k.du + m0 * (K / 256), j->k.bs32 + m0 * (K / 32),
                   j->k.o16 + m0 * (K / 16), bias, y + m0 * j->ldy, j->ldy, nc, m1 - m0);
    } else {   /* Q5_0, Q5_1, IQ4_NL: a unit is one 32-k block, the per-32 activations serve (s16 for o16) */
        kq_panel_k(fmt, wp, K, j->a.qx + m0 * K, j->a.dx + m0 * KB, j->a.sx + m0 * KB, j->a.s16 + m0 * KB, bias,
                   y + m0 * j->ldy, j->ldy, nc, m1 - m0);
    }
}

/* y[M, sum n] = x[M, K] . [W_0; W_1; ...]^T (+ biases): activations quantized once for every segment.
 * Returns 0, -1 for a format or K a segment cannot take, -2 when out of memory. */
int kq_linear(const float *x, int64_t ldx, const kq_linear_t *L, float *y, int64_t ldy, int64_t M,
              int64_t num_threads) {
    const int64_t K = L->k;
    if (K % QK || L->num_segments < 1 || L->num_segments > KQ_MAX_SEGMENTS) return -1;
    for (int64_t s = 0; s < L->num_segments; s++)
        if (L->seg[s].fmt < 0 || L->seg[s].fmt >= FMT_END || K % kn_unit_k((int)L->seg[s].fmt))
            return -1;
    if (M <= 0) return 0;
    const int64_t KB = K / QK, blocks = (M + MC - 1) / MC;
    linear_job job = {L, x, ldx, ldy, M, y, {0}, {0}, 0, 0, {0}, {0}, {0}, {0}};
    for (int64_t s = 0; s < L->num_segments; s++) {
        if (acts256((int)L->seg[s].fmt)) job.has_k = 1;
        else job.has_other = 1;
    }
    const int64_t n_other = job.has_other ? M : 0, n_k = job.has_k ? M : 0;
    /* malloc(0) may return NULL: every buffer gets at least one byte */
    job.a.qx = malloc((size_t)(n_other * K) + 1);
    job.a.dx = malloc(sizeof(float) * n_other * KB + 1);
    job.a.sxd = malloc(sizeof(float) * n_other * KB + 1);
    job.a.sx = malloc(sizeof(int32_t) * n_other * KB + 1);
    job.a.s16 = malloc(sizeof(int32_t) * n_other * KB + 1);
    job.k.qx = malloc((size_t)(n_k * K) + 1);
    job.k.du = malloc(sizeof(float) * n_k * (K / 256) + 1);
    job.k.bs32 = malloc(sizeof(int32_t) * n_k * (K / 32) + 1);
    job.k.o16 = malloc(sizeof(int32_t) * n_k * (K / 16) + 1);
    if (!job.a.qx || !job.a.dx || !job.a.sxd || !job.a.sx || !job.a.s16 || !job.k.qx || !job.k.du || !job.k.bs32 ||
        !job.k.o16) {
        free(job.a.qx); free(job.a.dx); free(job.a.sxd); free(job.a.sx); free(job.a.s16);
        free(job.k.qx); free(job.k.du); free(job.k.bs32); free(job.k.o16);
        return -2;
    }
    int64_t col = 0;
    for (int64_t s = 0; s < L->num_segments; s++) {
        job.col[s] = col;
        col += L->seg[s].n;
        job.panels[s] = (L->seg[s].n + NR - 1) / NR;
        const int fmt = (int)L->seg[s].fmt;
        job.streamed[s] = L->seg[s].n * (K / kn_unit_k(fmt)) * kn_unit_bytes(fmt) >= STREAMED_LAYER_BYTES;
        job.first_item[s + 1] = job.first_item[s] + job.panels[s] * blocks;
    }
    pool_for(M, quantize_item, &job, M * K < 16384 ? 1 : num_threads);   /* a few rows: not worth a thread */
    pool_for(job.first_item[L->num_segments], linear_item, &job, num_threads);
    free(job.a.qx); free(job.a.dx); free(job.a.sxd); free(job.a.sx); free(job.a.s16);
    free(job.k.qx); free(job.k.du); free(job.k.bs32); free(job.k.o16);
    return 0;
}
