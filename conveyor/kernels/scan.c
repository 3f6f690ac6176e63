/* Non-finite numbers in a GGUF tensor's bytes, found before any kernel computes with them.
 *
 * A block of a quantized tensor holds a few float scales (16-bit IEEE half in every GGUF block type);
 * a float tensor is all floats. A NaN or infinity has every exponent bit set, so the scan is a masked
 * compare per value, over the tensor in chunks claimed by the pool's threads.
 *
 * Contract: raw holds num_blocks blocks of block_bytes; each block's num_fields values of `fmt`
 * (FMT_F32, FMT_BF16 or FMT_F16, half.h) start at byte `offset`, back to back, inside the block.
 * The caller (conveyor/kernels/scan.py) has checked that the tensor's bytes are all there. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define SCAN_CHUNK 65536   /* blocks per work item: large enough that claiming one costs nothing */

typedef struct {
    const uint8_t *raw;
    int64_t num_blocks, block_bytes, offset, num_fields;
    int fmt;
    int64_t first_bad;      /* the lowest bad block found so far, or num_blocks */
} scan_job;

/* A float tensor (one value per "block"): a branch-free pass per stretch, vectorisable; the exact
 * element is looked for only in a stretch known to hold one. */
#define SCAN_PACKED(T, MASK)                                                        \
    for (int64_t b = from; b < to; b += 4096) {                                     \
        const int64_t end = b + 4096 < to ? b + 4096 : to;                          \
        int bad = 0;                                                                \
        for (int64_t i = b; i < end; i++) {                                         \
            T v;                                                                    \
            memcpy(&v, j->raw + sizeof(T) * i, sizeof(T));                         \
            bad |= (v & (MASK)) == (MASK);                                          \
        }                                                                           \
        if (bad)                                                                    \
            for (int64_t i = b; i < end; i++) {                                     \
                T v;                                                                \
                memcpy(&v, j->raw + sizeof(T) * i, sizeof(T));                      \
                if ((v & (MASK)) == (MASK)) return i;                               \
            }                                                                       \
    }                                                                               \
    return -1;

static int64_t scan_packed32(const scan_job *j, int64_t from, int64_t to) { SCAN_PACKED(uint32_t, 0x7f800000u) }
static int64_t scan_packed16(const scan_job *j, int64_t from, int64_t to, uint16_t mask) { SCAN_PACKED(uint16_t, mask) }

/* Blocks with 16-bit scales (every GGUF block type): fixed-size loads, one or two per block. */
static int64_t scan_blocks16(const scan_job *j, int64_t from, int64_t to, uint16_t mask) {
    const uint8_t *p = j->raw + from * j->block_bytes + j->offset;
    for (int64_t b = from; b < to; b++, p += j->block_bytes) {
        uint16_t v0, v1 = 0;
        memcpy(&v0, p, 2);
        if (j->num_fields > 1) memcpy(&v1, p + 2, 2);
        int bad = (v0 & mask) == mask || (j->num_fields > 1 && (v1 & mask) == mask);
        for (int64_t f = 2; f < j->num_fields; f++) {
            uint16_t v;
            memcpy(&v, p + 2 * f, 2);
            bad |= (v & mask) == mask;
        }
        if (bad) return b;
    }
    return -1;
}

static int64_t scan_range(const scan_job *j, int64_t from, int64_t to) {
    const int64_t width = fmt_size(j->fmt);
    const uint16_t mask16 = j->fmt == FMT_F16 ? 0x7c00u : 0x7f80u;
    if (j->block_bytes == width && j->num_fields == 1)
        return width == 4 ? scan_packed32(j, from, to) : scan_packed16(j, from, to, mask16);
    if (width == 2) return scan_blocks16(j, from, to, mask16);
    for (int64_t b = from; b < to; b++) {
        const uint8_t *p = j->raw + b * j->block_bytes + j->offset;
        int bad = 0;
        for (int64_t f = 0; f < j->num_fields; f++) {
            uint32_t v;
            memcpy(&v, p + 4 * f, 4);
            bad |= (v & 0x7f800000u) == 0x7f800000u;
        }
        if (bad) return b;
    }
    return -1;
}

static void scan_chunk(void *arg, int64_t item) {
    scan_job *j = arg;
    const int64_t from = item * SCAN_CHUNK;
    const int64_t to = from + SCAN_CHUNK < j->num_blocks ? from + SCAN_CHUNK : j->num_blocks;
    const int64_t bad = scan_range(j, from, to);
    if (bad < 0) return;
    int64_t seen = __atomic_load_n(&j->first_bad, __ATOMIC_RELAXED);
    while (bad < seen && !__atomic_compare_exchange_n(&j->first_bad, &seen, bad, 0, __ATOMIC_RELAXED,
                                                      __ATOMIC_RELAXED)) {
    }
}

/* The first block holding a NaN or infinity, or -1 when there is none (or the arguments are bad). */
int64_t scan_nonfinite(const uint8_t *raw, int64_t num_blocks, int64_t block_bytes, int64_t offset,
                       int64_t num_fields, int fmt, int64_t num_threads) {
    if (num_blocks < 0 || block_bytes <= 0 || offset < 0 || num_fields <= 0 ||
        (fmt != FMT_F32 && fmt != FMT_BF16 && fmt != FMT_F16) ||
        offset + num_fields * fmt_size(fmt) > block_bytes)
        return -2;
    scan_job job = {raw, num_blocks, block_bytes, offset, num_fields, fmt, num_blocks};
    pool_for((num_blocks + SCAN_CHUNK - 1) / SCAN_CHUNK, scan_chunk, &job, num_threads);
    return job.first_bad < num_blocks ? job.first_bad : -1;
}
