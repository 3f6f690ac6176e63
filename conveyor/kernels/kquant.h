/* The repacked layout of kquant.c's formats (see the top of kquant.c), shared by the repacking and
 * the kernels. */
#ifndef CONVEYOR_KQUANT_H
#define CONVEYOR_KQUANT_H
#include <stdint.h>

#define QK 32   /* weights per block along K */
#define NR 32   /* output channels per panel */

enum { FMT_Q8 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_Q5_0 = 3, FMT_Q4_K = 4, FMT_Q5_K = 5, FMT_Q6_K = 6, FMT_END };

/* ------------------------------------------------------------------ format geometry */

static inline int64_t unit_k(int fmt) { return fmt == FMT_Q5_0 ? 32 : 256; }
static inline int64_t header_bytes(int fmt) { return fmt == FMT_Q5_0 ? 64 : fmt == FMT_Q6_K ? 576 : 640; }
static inline int64_t high_bytes(int fmt) { return fmt == FMT_Q6_K ? 256 : fmt == FMT_Q4_K ? 0 : 128; }
static inline int64_t body_bytes(int fmt) { return 512 + high_bytes(fmt); }
static inline int64_t unit_bytes(int fmt) { return header_bytes(fmt) + unit_k(fmt) / QK * body_bytes(fmt); }
/* The file's block: bytes per unit_k weights of one row. */
static inline int64_t file_block_bytes(int fmt) {
    return fmt == FMT_Q5_0 ? 22 : fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210;
}

float kq_half_to_float(uint16_t h);
int64_t quant_panel_bytes(int fmt, int64_t K);   /* quant.c: one panel of its formats */

#endif
