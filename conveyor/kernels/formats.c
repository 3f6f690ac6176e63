/* The format table and code path as this build compiled them, for Python to check against its own
 * reading of kernels.h (kernels/formats.py): a header edited without Python noticing, or a library
 * built from other sources, fails at load instead of misreading weights. */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* Where each file block keeps its first 16-bit scale. */
#define KN_SCALE_AT(NAME, name, ...) [FMT_##NAME] = offsetof(block_##name, d),
static const int64_t SCALE_AT[FMT_END] = {KN_FORMATS(KN_SCALE_AT)};
#undef KN_SCALE_AT

/* One row of KN_COLUMNS values per format, in code order: code, weights, bytes, acts, header, low, high,
 * zero, scales (KN_FORMATS' columns), then the offset of the file block's first scale. Weights, header,
 * low, high (and the legacy formats' zero) come from the functions the kernels call (code_bytes...,
 * unit_k...), so a table edited without them fails the check. Returns the number of rows, or -1 when
 * `capacity` (values) is too small. */
#define KN_COLUMNS 10
int64_t kn_formats(int64_t *out, int64_t capacity) {
    if (capacity < FMT_END * KN_COLUMNS) return -1;
    for (int fmt = 0; fmt < FMT_END; fmt++) {
        const int legacy = legacy_format(fmt);
        const int64_t row[KN_COLUMNS] = {
            fmt, legacy ? QK : unit_k(fmt), kn_file_bytes(fmt), acts256(fmt) ? 256 : 32,
            legacy ? block_bytes(fmt) - code_bytes(fmt) : header_bytes(fmt), legacy ? code_bytes(fmt) : low_bytes(fmt),
            legacy ? 0 : high_bytes(fmt), legacy ? zero_point(fmt) : KN_FORMAT[fmt].zero, KN_FORMAT[fmt].scales,
            SCALE_AT[fmt]};
        for (int c = 0; c < KN_COLUMNS; c++) out[fmt * KN_COLUMNS + c] = row[c];
    }
    return FMT_END;
}

/* sizeof(kq_linear_t), which Python builds as quant.LinearSpec. */
int64_t kn_linear_bytes(void) { return (int64_t)sizeof(kq_linear_t); }

/* The quantized kernels' code path in this build (kernels.h's tiers). */
const char *kn_isa_name(void) {
    static const char *const names[] = {[KN_ISA_PORTABLE] = "portable", [KN_ISA_AVX2] = "avx2",
                                        [KN_ISA_AVX512_VNNI] = "avx512-vnni", [KN_ISA_AVX2_VNNI] = "avx2-vnni"};
    return names[KN_ISA];
}
