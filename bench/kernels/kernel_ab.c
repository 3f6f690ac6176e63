/* Two builds of the quantized linear layer in one process, alternated: the tree's (kq_linear) and a
 * baseline's, compiled with its entry points renamed (base_*). Each round runs one decode step's
 * matmuls (M rows) over LAYERS layers of distinct weights, once with each build (the order flips every
 * round), then the same buffers are read by the stream kernel: the wall for exactly these bytes.
 * Prints one line of JSON. Usage: kernel_ab SHAPES LAYERS ROUNDS M THREADS, SHAPES as
 * fmt:N:K[,fmt:N:K...] with fmt a format code. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kernels.h"

int base_kq_linear(const float *x, int64_t ldx, const kq_linear_t *L, float *y, int64_t ldy, int64_t M,
                   int64_t num_threads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Where each file block keeps its 16-bit scales (kernels.h's typed blocks; KN_FORMAT's `scales` of them). */
#define SCALE_AT(NAME, name, ...) [FMT_##NAME] = offsetof(block_##name, d),
static const int64_t scale_at[FMT_END] = {KN_FORMATS(SCALE_AT)};
#undef SCALE_AT

/* Random codes with small sane scales (the speed does not depend on the values), repacked. */
static uint8_t *weight(int fmt, int64_t N, int64_t K) {
    const int64_t uk = kn_unit_k(fmt), fb = kn_file_bytes(fmt), row = K / uk * fb;
    uint8_t *raw = malloc((size_t)(N * row));
    for (int64_t i = 0; i < N * row; i++) raw[i] = (uint8_t)rand();
    const uint16_t h = 0x1400;   /* ~1e-3 */
    for (int64_t i = 0; i < N * K / uk; i++)
        for (int64_t c = 0; c < KN_FORMAT[fmt].scales; c++) memcpy(raw + i * fb + scale_at[fmt] + 2 * c, &h, 2);
    /* 2 MiB pages where the kernel allows, as the engine's weight buffers (kernels/quant.py) */
    const size_t huge = (size_t)2 << 20, size = (size_t)((kq_packed_bytes(fmt, N, K) + huge - 1) / huge * huge);
    uint8_t *w = aligned_alloc(huge, size);
#ifdef MADV_HUGEPAGE
    madvise(w, size, MADV_HUGEPAGE);
#endif
    kq_repack(fmt, raw, row, NULL, N, K, w, 2);
    free(raw);
    return w;
}

static int cmp(const void *a, const void *b) { return (*(const double *)a > *(const double *)b) - (*(const double *)a < *(const double *)b); }

int main(int argc, char **argv) {
    if (argc < 6) return 2;
    int64_t sh[16][3], n = 0, maxn = 0, maxk = 0;
    for (char *tok = strtok(argv[1], ","); tok && n < 16; tok = strtok(NULL, ","), n++) {
        if (sscanf(tok, "%" SCNd64 ":%" SCNd64 ":%" SCNd64, &sh[n][0], &sh[n][1], &sh[n][2]) != 3) return 2;
        if (sh[n][1] > maxn) maxn = sh[n][1];
        if (sh[n][2] > maxk) maxk = sh[n][2];
    }
    const int layers = atoi(argv[2]), rounds = atoi(argv[3]), M = atoi(argv[4]), threads = atoi(argv[5]);
    if (layers < 1 || rounds < 2 || rounds > 1000 || M < 1 || n < 1) return 2;
    uint8_t **w = malloc(sizeof(uint8_t *) * (size_t)(layers * n));
    double bytes = 0;
    for (int l = 0; l < layers; l++)
        for (int k = 0; k < n; k++) {
            w[l * n + k] = weight((int)sh[k][0], sh[k][1], sh[k][2]);
            bytes += (double)kq_packed_bytes((int)sh[k][0], sh[k][1], sh[k][2]);
        }
    float *x = malloc(sizeof(float) * (size_t)(M * maxk)), *y = malloc(sizeof(float) * (size_t)(M * maxn));
    for (int64_t i = 0; i < M * maxk; i++) x[i] = (float)(rand() % 2001 - 1000) / 1000.f;
    double *t[2] = {malloc(sizeof(double) * (size_t)rounds), malloc(sizeof(double) * (size_t)rounds)};
    double *ratio = malloc(sizeof(double) * (size_t)rounds), stream = 0;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < 2; i++) {
            const int v = r % 2 ? 1 - i : i;   /* 0: the tree, 1: the baseline */
            const double a = now();
            for (int l = 0; l < layers; l++)
                for (int k = 0; k < n; k++) {
                    kq_linear_t L = {1, sh[k][2], {{sh[k][0], sh[k][1], w[l * n + k], NULL}}};
                    (v ? base_kq_linear : kq_linear)(x, sh[k][2], &L, y, sh[k][1], M, threads);
                }
            t[v][r] = now() - a;
        }
        const double a = now();
        for (int l = 0; l < layers; l++)
            for (int k = 0; k < n; k++)
                kq_stream_read(w[l * n + k], kq_packed_bytes((int)sh[k][0], sh[k][1], sh[k][2]) / 256 * 256, 1 << 20, threads);
        stream += now() - a;
        ratio[r] = t[1][r] / t[0][r];
    }
    double s0 = 0, s1 = 0;
    for (int r = 0; r < rounds; r++) s0 += t[0][r], s1 += t[1][r];
    qsort(ratio, (size_t)rounds, sizeof(double), cmp);
    printf("{\"bytes\": %.0f, \"tree_gb_s\": %.3f, \"baseline_gb_s\": %.3f, \"stream_gb_s\": %.3f, "
           "\"speedup_median\": %.4f, \"speedup_q1\": %.4f, \"speedup_q3\": %.4f}\n",
           bytes, bytes * rounds / s0 / 1e9, bytes * rounds / s1 / 1e9, bytes * rounds / stream / 1e9,
           ratio[rounds / 2], ratio[rounds / 4], ratio[3 * rounds / 4]);
    return 0;
}
