/* Rows of 16-bit floats widened to float32 and narrowed back: bfloat16 (activations, KV cache) and
 * IEEE half (the KV cache, as llama.cpp keeps it). Narrowing rounds to nearest even in both.
 * Element formats: 0 float32, 1 bfloat16, 2 float16, 3 int8 (the 8-bit KV cache: codes with a float16
 * scale per token and KV head, laid out as model/kv_quant.py describes). */
#ifndef CONVEYOR_HALF_H
#define CONVEYOR_HALF_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_F16 = 2, FMT_I8 = 3 };

static inline int64_t fmt_size(int fmt) { return fmt == FMT_F32 ? 4 : fmt == FMT_I8 ? 1 : 2; }

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x400000u;   /* NaN stays NaN */
    else bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) bits = sign | 0x7f800000u | (man << 13);        /* inf, NaN */
    else if (exp != 0) bits = sign | ((exp + 112u) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else {                                                            /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = (bits >> 16) & 0x8000u, absb = bits & 0x7fffffffu;
    if (absb > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);        /* NaN */
    if (absb >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);       /* rounds past 65504: inf */
    if (absb < 0x38800000u) {                                         /* subnormal or zero */
        if (absb < 0x33000000u) return (uint16_t)sign;
        const uint32_t e = absb >> 23, m = (absb & 0x7fffffu) | 0x800000u, shift = 126u - e;
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((absb >> 13) - (112u << 10));
    const uint32_t rest = absb & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
#endif
}

/* dst[0..n) = the n elements of `fmt` at base + offset (in elements), widened. */
static inline void load_fmt(float *dst, const void *base, int64_t offset, int64_t n, int fmt) {
    if (fmt == FMT_F32) {
        memcpy(dst, (const float *)base + offset, n * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)base + offset;
    int64_t i = 0;
    if (fmt == FMT_BF16) {
        for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
        return;
    }
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = f16_to_f32(src[i]);
}

/* The n floats of src into `fmt` at base + offset, rounded to nearest even. */
static inline void store_fmt(void *base, int64_t offset, const float *src, int64_t n, int fmt) {
    if (fmt == FMT_F32) {
        memcpy((float *)base + offset, src, n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)base + offset;
    int64_t i = 0;
    if (fmt == FMT_BF16) {
        for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
        return;
    }
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

/* Bytes of one layer's int8 K (or V) block: bs * KV * D codes, then bs * KV float16 scales, padded to 16. */
static inline int64_t i8_block_bytes(int64_t bs, int64_t KV, int64_t D) {
    return (bs * KV * D + 2 * bs * KV + 15) / 16 * 16;
}

/* One vector's int8 codes: scale = absmax / 127 in float16, code = x / scale rounded to nearest even
 * (model/kv_quant.py's quantize does the same arithmetic). Returns the scale's float16 bits. */
static inline uint16_t quantize_i8(const float *x, int64_t n, int8_t *codes) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) {
        const float a = x[i] < 0.f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
    }
    const uint16_t h = f32_to_f16(amax / 127.f);
    const float s = f16_to_f32(h);
    for (int64_t i = 0; i < n; i++) {
        float c = s > 0.f ? __builtin_rintf(x[i] / s) : 0.f;
        c = c > 127.f ? 127.f : c < -127.f ? -127.f : c;
        codes[i] = (int8_t)c;
    }
    return h;
}

static inline void store_one(void *base, int64_t i, float f, int fmt) {
    if (fmt == FMT_F32) ((float *)base)[i] = f;
    else if (fmt == FMT_BF16) ((uint16_t *)base)[i] = f32_to_bf16(f);
    else ((uint16_t *)base)[i] = f32_to_f16(f);
}

#endif
