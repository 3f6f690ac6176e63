/* The C kernels' one contract: every .c includes this header and nothing else of another's.
 *
 *   1. the code paths: the one place the compiler's instruction-set macros become tiers;
 *   2. the block formats: one table (KN_FORMATS) of codes and sizes, the file's blocks as typed
 *      structs and our repacked panels as typed structs, every size checked by the compiler;
 *   3. the entry points: one prototype per function another .c or Python calls.
 *
 * Python reads the same table from this file (kernels/formats.py), and the library reports the
 * table it was compiled with (kn_formats, formats.c), so the two are compared at load and in tests.
 */
#ifndef CONVEYOR_KERNELS_H
#define CONVEYOR_KERNELS_H
#include <stddef.h>
#include <stdint.h>

#include "half.h"
#include "pool.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ 1. code paths
 * Build.py turns each CPU feature into its -m flag; these are what the flags make of the code. The
 * integer kernels (quant.c, kquant_k.c) have four tiers (KN_ISA; kn_isa_name() says which). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KN_AVX2 1
#else
#define KN_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KN_AVX512 1        /* the float tiles (gemm.c) */
#else
#define KN_AVX512 0
#endif
#if KN_AVX512 && defined(__AVX512BF16__)
#define KN_AVX512_BF16 1
#else
#define KN_AVX512_BF16 0
#endif
#if KN_AVX512 && defined(__AVX512VNNI__) && defined(__F16C__)
#define KN_VNNI512 1
#else
#define KN_VNNI512 0
#endif
/* 256-bit vpdpbusd in the AVX2 tiles: AVX-VNNI, or AVX512-VNNI with VL (its EVEX form: KN_VNNI256_EVEX) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KN_VNNI256_EVEX 1
#else
#define KN_VNNI256_EVEX 0
#endif
#if !KN_VNNI512 && KN_AVX2 && (defined(__AVXVNNI__) || KN_VNNI256_EVEX)
#define KN_VNNI256 1
#else
#define KN_VNNI256 0
#endif

#define KN_ISA_PORTABLE 0
#define KN_ISA_AVX2 1
#define KN_ISA_AVX512_VNNI 2
#define KN_ISA_AVX2_VNNI 3
#if KN_VNNI512
#define KN_ISA KN_ISA_AVX512_VNNI
#elif KN_VNNI256
#define KN_ISA KN_ISA_AVX2_VNNI
#elif KN_AVX2
#define KN_ISA KN_ISA_AVX2
#else
#define KN_ISA KN_ISA_PORTABLE
#endif

/* ------------------------------------------------------------------ 2. block formats */

#define QK 32   /* weights per block along K */
#define NR 32   /* output channels per panel */

/* One row per weight format the kernels run, in code order:
 *   NAME, name   the GGUF type and our name for it (block_<name>, kn_panel_<name> below)
 *   code         the format code (FMT_<NAME>) the kernels and Python pass
 *   weights      weights per file block along K: also per unit of a repacked panel
 *   bytes        bytes per file block (sizeof block_<name>)
 *   acts         k per activation scale: 32, or 256 (llama.cpp's Q8_K)
 *   header, low, high   a repacked unit: bytes of its per-channel scales, then per 32-k block the bytes
 *                of its low bits' plane and its high bits' plane (sizeof kn_panel_<name> = header +
 *                weights / 32 * (low + high))
 *   zero         codes are unsigned: a weight is d * (code - zero) (+ a min); IQ4's codes are its
 *                table's values + 128, looked up from the file's indices
 *   scales       16-bit float scales from the file block's `d` on (2: d and a min)
 *   legacy       1: quant.c's kernel and layout (a unit's codes, then its scales); 0: kquant_k.c's */
#define KN_FORMATS(X)                                                              \
    /*  NAME    name  code weights bytes acts header  low high zero scales legacy */      \
    X(Q8_0,   q8_0,    0,   32,   34,  32,   64, 1024,   0, 128,   1,    1)          \
    X(Q4_0,   q4_0,    1,   32,   18,  32,   64,  512,   0,   8,   1,    1)          \
    X(Q4_1,   q4_1,    2,   32,   20,  32,  128,  512,   0,   0,   2,    1)          \
    X(Q5_0,   q5_0,    3,   32,   22,  32,   64,  512, 128,  16,   1,    0)          \
    X(Q4_K,   q4_k,    4,  256,  144, 256,  512,  512,   0,   0,   2,    0)          \
    X(Q5_K,   q5_k,    5,  256,  176, 256,  512,  512, 128,   0,   2,    0)          \
    X(Q6_K,   q6_k,    6,  256,  210, 256,  576,  512, 256,  32,   1,    0)          \
    X(Q5_1,   q5_1,    7,   32,   24,  32,  128,  512, 128,   0,   2,    0)          \
    X(IQ4_NL, iq4_nl,  8,   32,   18,  32,   64,  512,   0, 128,   1,    0)          \
    X(IQ4_XS, iq4_xs,  9,  256,  136, 256,  320,  512,   0, 128,   1,    0)          \
    X(Q3_K,   q3_k,   10,  256,  110, 256,  576,  256, 128,   4,   1,    0)

#define KN_ENUM(NAME, name, code, ...) FMT_##NAME = code,
enum { KN_FORMATS(KN_ENUM) FMT_END };
#undef KN_ENUM

typedef struct {
    int64_t weights, bytes, acts, header, low, high, zero, scales, legacy;
} kn_format;

#define KN_ROW(NAME, name, code, weights, bytes, acts, header, low, high, zero, scales, legacy) \
    [code] = {weights, bytes, acts, header, low, high, zero, scales, legacy},
static const kn_format KN_FORMAT[FMT_END] __attribute__((unused)) = {KN_FORMATS(KN_ROW)};
#undef KN_ROW

/* The file's blocks, as GGUF (llama.cpp's ggml-common.h) lays them out. Packed: a row of a
 * memory-mapped file may start at any byte, so no field assumes alignment. */
typedef uint16_t kn_half;   /* IEEE half, read with f16_to_f32 */
#define KN_PACKED __attribute__((packed))
typedef struct KN_PACKED { kn_half d; int8_t qs[32]; } block_q8_0;
typedef struct KN_PACKED { kn_half d; uint8_t qs[16]; } block_q4_0;   /* k < 16 low nibbles, k >= 16 high */
typedef struct KN_PACKED { kn_half d, m; uint8_t qs[16]; } block_q4_1;
typedef struct KN_PACKED { kn_half d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;   /* qh: bit 4 of each k */
typedef struct KN_PACKED { kn_half d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1;
typedef struct KN_PACKED { kn_half d; uint8_t qs[16]; } block_iq4_nl;    /* indices into the IQ4 table */
typedef struct KN_PACKED { kn_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } block_iq4_xs;
typedef struct KN_PACKED { uint8_t hmask[32], qs[64], scales[12]; kn_half d; } block_q3_k;
typedef struct KN_PACKED { kn_half d, dmin; uint8_t scales[12], qs[128]; } block_q4_k;   /* 6-bit scales, mins */
typedef struct KN_PACKED { kn_half d, dmin; uint8_t scales[12], qh[32], qs[128]; } block_q5_k;
typedef struct KN_PACKED { uint8_t ql[128], qh[64]; int8_t scales[16]; kn_half d; } block_q6_k;

/* Our panels: NR = 32 output channels side by side, a run of units along K. The legacy formats'
 * unit (quant.c) is one 32-k block: its codes u8[8 groups][32 ch][4 k] (Q8_0) or nibbles
 * u8[8 groups][16 ch][4 k] (low nibble channel c, high c + 16), then the scales d[32] (and m[32]).
 * The others' unit (kquant_k.c) is a header of per-channel scales, then its 32-k blocks: nibbles as
 * above (one 64-byte line serves all 32 channels of a group), then the high bits so that a group's
 * line up with its nibbles:
 *   Q5_*, Q3_K  u8[2][16][4 k]: byte (g / 4), bit 2 (g % 4) for channel c, + 1 for c + 16  128 B
 *   Q6_K  u8[4][16][4 k]: byte (g / 2), bits 4 (g % 2) for channel c, + 2 for c + 16    256 B
 * Q3_K's low 2 bits take the nibbles' place as u8[4][16][4 k]: byte (g / 2), bits 4 (g % 2) for
 * channel c, + 2 for c + 16. Q6_K's planes alternate, two low lines then their high line, so a block
 * is read front to back. IQ4's nibbles index its table of values. */
typedef uint8_t kn_line[16][4];   /* one group (4 k) of 16 channel pairs, or of 32 channels' bits */
typedef struct { uint8_t codes[8][NR][4]; } kn_body8;
typedef struct { kn_line low[8]; } kn_body4;
typedef struct { kn_line low[8], high[2]; } kn_body5;
typedef struct { kn_line low[4], high[2]; } kn_body3;
typedef struct { struct { kn_line low[2], high; } pair[4]; } kn_body6;
typedef struct { kn_body8 block; kn_half d[NR]; } kn_panel_q8_0;
typedef struct { kn_body4 block; kn_half d[NR]; } kn_panel_q4_0;
typedef struct { kn_body4 block; kn_half d[NR], m[NR]; } kn_panel_q4_1;
typedef struct { kn_half d[NR]; kn_body5 block; } kn_panel_q5_0;
typedef struct { kn_half d[NR], m[NR]; kn_body5 block; } kn_panel_q5_1;
typedef struct { kn_half d[NR]; kn_body4 block; } kn_panel_iq4_nl;
typedef struct { kn_half d[NR]; int8_t sc[8][NR]; kn_body4 block[8]; } kn_panel_iq4_xs;
typedef struct { kn_half d[NR]; int8_t sc[16][NR]; kn_body3 block[8]; } kn_panel_q3_k;
/* S[j] = sc_j | (m_j >> 4) << 6, ML[p] = m_2p & 15 | (m_2p+1 & 15) << 4: the file's 6-bit bytes */
typedef struct { kn_half d[NR], dmin[NR]; uint8_t S[8][NR], ML[4][NR]; kn_body4 block[8]; } kn_panel_q4_k;
typedef struct { kn_half d[NR], dmin[NR]; uint8_t S[8][NR], ML[4][NR]; kn_body5 block[8]; } kn_panel_q5_k;
typedef struct { kn_half d[NR]; int8_t sc[16][NR]; kn_body6 block[8]; } kn_panel_q6_k;

#define KN_CHECK(NAME, name, code, weights, bytes, acts, header, low, high, zero, scales, legacy)                 \
    _Static_assert(sizeof(block_##name) == (bytes), "block_" #name ": the file's block size");              \
    _Static_assert(sizeof(kn_panel_##name) == (header) + (weights) / QK * ((low) + (high)),                \
                   "kn_panel_" #name ": a repacked unit's size");                                          \
    _Static_assert(offsetof(kn_panel_##name, block) == ((legacy) ? 0 : (header)), "kn_panel_" #name ": header"); \
    _Static_assert((code) < FMT_END && (weights) % QK == 0, #name ": code or block size");
KN_FORMATS(KN_CHECK)
#undef KN_CHECK

/* Any format's unit, read from the table (repacking, dispatch: code that is not a hot loop). */
static inline int64_t kn_unit_k(int fmt) { return KN_FORMAT[fmt].weights; }
static inline int64_t kn_file_bytes(int fmt) { return KN_FORMAT[fmt].bytes; }
static inline int64_t kn_unit_bytes(int fmt) {
    return KN_FORMAT[fmt].header + KN_FORMAT[fmt].weights / QK * (KN_FORMAT[fmt].low + KN_FORMAT[fmt].high);
}
/* quant.c's formats (Q8_0, Q4_0, Q4_1): codes first, scales after; the rest are kquant_k.c's. */
static inline int legacy_format(int fmt) { return (int)KN_FORMAT[fmt].legacy; }

/* The same numbers as the hot loops spell them: tests on fmt, which gcc folds where fmt is a constant
 * into the code it has always made of them (a lookup in KN_FORMAT compiles the loops differently).
 * kn_formats() (formats.c) reports what they give and Python checks it against KN_FORMATS. */
/* quant.c's formats: a unit is one 32-k block, codes then scales. */
static inline int64_t code_bytes(int fmt) { return fmt == FMT_Q8_0 ? 1024 : 512; }
static inline int64_t block_bytes(int fmt) { return code_bytes(fmt) + (fmt == FMT_Q4_1 ? 128 : 64); }
static inline int zero_point(int fmt) { return fmt == FMT_Q8_0 ? 128 : fmt == FMT_Q4_0 ? 8 : 0; }
/* kquant_k.c's formats: weights per unit along K, then the unit's header and its blocks' planes. */
static inline int64_t unit_k(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_IQ4_NL ? 32 : 256; }
static inline int64_t header_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q5_0: case FMT_IQ4_NL: return 64;
        case FMT_Q5_1: return 128;
        case FMT_IQ4_XS: return 320;
        case FMT_Q6_K: case FMT_Q3_K: return 576;
        default: return 512;
    }
}
/* The low bits' plane of a block (nibbles; Q3_K: 2 bits), then its high bits' plane. */
static inline int64_t low_bytes(int fmt) { return fmt == FMT_Q3_K ? 256 : 512; }
static inline int64_t high_bytes(int fmt) {
    return fmt == FMT_Q6_K ? 256 : fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_Q5_K || fmt == FMT_Q3_K ? 128 : 0;
}
static inline int64_t body_bytes(int fmt) { return low_bytes(fmt) + high_bytes(fmt); }
static inline int64_t unit_bytes(int fmt) { return header_bytes(fmt) + unit_k(fmt) / QK * body_bytes(fmt); }
/* Where group g's (4 k of 32 channels) low and high bits start in its block (kquant_k.c's formats). */
static inline int64_t low_line(int fmt, int g) {
    return fmt == FMT_Q6_K ? (g / 2) * 192 + (g % 2) * 64 : fmt == FMT_Q3_K ? (g / 2) * 64 : g * 64;
}
static inline int64_t high_line(int fmt, int g) {
    return fmt == FMT_Q6_K ? (g / 2) * 192 + 128 : low_bytes(fmt) + (g / 4) * 64;
}
/* Formats whose activations are quantized per 256 k (llama.cpp's Q8_K); the others' per 32 k. */
static inline int acts256(int fmt) { return fmt >= 0 && fmt < FMT_END && KN_FORMAT[fmt].acts == 256; }
/* IQ4's codes are a table's values + 128 (up to 241): a dot needs more than int16 pairs. */
static inline int wide_codes(int fmt) { return fmt == FMT_IQ4_NL || fmt == FMT_IQ4_XS; }

/* ------------------------------------------------------------------ 3. entry points */

/* A quantized linear layer: segments along N, each in its own format, over one K (Python: quant.LinearSpec). */
#define KQ_MAX_SEGMENTS 4
typedef struct {
    int64_t fmt, n;           /* format code, output channels */
    const uint8_t *w;         /* repacked panels */
    const float *bias;        /* (n,) or NULL */
} kq_segment;
typedef struct kq_linear {
    int64_t num_segments, k;
    kq_segment seg[KQ_MAX_SEGMENTS];
} kq_linear_t;

/* formats.c */
int64_t kn_formats(int64_t *out, int64_t capacity);
int64_t kn_linear_bytes(void);
const char *kn_isa_name(void);
/* kquant.c: the linear layer, and the legacy and 32-k formats' activations */
int kq_linear(const float *x, int64_t ldx, const kq_linear_t *L, float *y, int64_t ldy, int64_t M, int64_t num_threads);
int quant_activations(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *q, float *d);
/* quant.c: rows m0..m1 of one Q8_0 / Q4_0 / Q4_1 panel over activations quantized by kquant.c */
void quant_panel_rows(int fmt, const uint8_t *wp, int64_t KB, const int8_t *qx, int64_t K, const float *dx,
                      const int32_t *sx, const float *sxd, const float *bias, float *y, int64_t ldy, int64_t nc,
                      int64_t m0, int64_t m1, int stream);
/* kquant_k.c: Q8_K-style activations (per 256-k unit: scale; sums per 32; 32 x sums per 16) and a panel */
void kq_quantize_row_k(const float *x, int64_t K, int8_t *q, float *du, int32_t *bs32, int32_t *o16);
int kq_activations_k(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *q, float *du);
void kq_panel_k(int fmt, const uint8_t *wp, int64_t K, const int8_t *qx, const float *du, const int32_t *bs32,
                const int32_t *o16, const float *bias, float *y, int64_t ldy, int64_t nc, int64_t M);
/* kquant_sets.c (AVX-512 VNNI builds): acc (M <= 64, NR) += rows [0, M) of one panel of kq_panel_k's formats in one
 * pass, its lines asked for `ahead` bytes before they are read (0: not asked for); -1 for a format it leaves alone */
#define KQ_SETS (KN_ISA == KN_ISA_AVX512_VNNI)
int kq_panel_sets(int fmt, const uint8_t *wp, int64_t K, const int8_t *qx, const float *du, const int32_t *bs32,
                  const int32_t *o16, int64_t M, float (*acc)[NR], int64_t ahead);
/* kquant_repack.c */
int64_t kq_packed_bytes(int fmt, int64_t N, int64_t K);
int kq_repack(int fmt, const uint8_t *raw, int64_t row_bytes, const int64_t *rows, int64_t N, int64_t K,
              uint8_t *out, int64_t num_threads);
/* gemm.c */
int gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, const float *res, int64_t ldr,
             float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads);
int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, const uint16_t *res,
              int64_t ldr, uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads);
int gemm_isa(void);
/* layer.c */
void rmsnorm(const void *x, int64_t ldx, const void *w, void *y, int64_t ldy, int64_t M, int64_t N, float eps,
             int is_bf16, int64_t num_threads);
int rope_cache(void *qkv, int64_t ld, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t R, const float *cos,
               const float *sin, const int64_t *pos, int64_t rows, const int64_t *slots, void *k_cache,
               void *v_cache, int64_t bs, const void *q_norm, const void *k_norm, float eps, int is_bf16, int kv_fmt, int64_t num_threads);
void gated_act(const void *x, int64_t ldx, void *y, int64_t ldy, int64_t M, int64_t I, int64_t act, int is_bf16,
               int64_t num_threads);
void add_rows(void *x, const void *y, int64_t n, int is_bf16);
void convert_fmt(const void *src, int src_fmt, void *dst, int dst_fmt, int64_t n);
/* decoder.c */
int64_t decoder_struct_bytes(int which);
/* attention.c */
int64_t attention_tile_size(int64_t H, int64_t KV, int64_t D, int64_t bs);
int paged_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache, const int64_t *tables,
                    int64_t max_blocks, const int64_t *rows, const int64_t *ctx_lens, const int64_t *tokens,
                    const int64_t *tile_start, int64_t tiles, int64_t H, int64_t KV, int64_t D, int64_t bs,
                    int64_t window, float scale, void *out, int64_t ldo, int64_t num_threads, int act_fmt,
                    int kv_fmt);
/* attention_i8.c: the 8-bit cache's scores as integer dots over chunks of 16 keys (int16 query codes with a scale
 * per 16 d, the query heads padded with zero codes to a multiple of ATTN_I8_QPAD; kt holds D * 32 bytes) */
#define ATTN_I8_QPAD 8
void attn_i8_query(const float *x, int64_t D, int16_t *codes, float *d);
void attn_i8_keys(const int8_t *codes, int64_t bs, int64_t n_keys, int64_t D, uint8_t *kt);
void attn_i8_scores(const uint8_t *kt, int64_t D, const int16_t *qc, int64_t ldqc, const float *qd, int64_t ldqd,
                    int64_t A, const float *kscale, float *p);
/* embed.c: token embedding rows from a table in the file's Q8_0 / Q4_0 / Q5_0 blocks */
int kn_embed_rows(int fmt, const uint8_t *table, int64_t num_rows, int64_t row_bytes, const int64_t *ids,
                  int64_t n, int64_t k, float *out);
/* sampling.c, argmax.c, scan.c, stream.c, shm_reduce.c */
void mask_logits(float *logits, int64_t stride, const int64_t *rows, int64_t n, const int32_t *masks,
                 int64_t words, int64_t vocab, int32_t *alive);
int argmax_rows(const float *logits, int64_t stride, int64_t n, int64_t vocab, int64_t *out, int64_t num_threads);
int64_t scan_nonfinite(const uint8_t *raw, int64_t num_blocks, int64_t block_bytes, int64_t offset,
                       int64_t num_fields, int fmt, int64_t num_threads);
int64_t kq_stream_read(const uint8_t *buf, int64_t bytes, int64_t chunk, int64_t num_threads);
int shm_allreduce(float *x, int64_t n, void *segment, int64_t slot_elems, int rank, int world, int64_t round,
                  const int64_t *pids, int64_t timeout_ns);

#endif
