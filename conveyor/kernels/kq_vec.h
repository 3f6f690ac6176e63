/* Sixteen 32-bit lanes (or 64 bytes) as one value, on every instruction set the K-quant kernel
 * runs on: one 512-bit register (AVX-512 VNNI), two 256-bit ones (AVX2, with or without 256-bit
 * VNNI) or plain arrays (portable). The kernel is written once over these operations; the integer
 * ones are exact and the float ones are the same IEEE operations everywhere (fused multiply-adds
 * written as such), so every path gives the same bits.
 *
 * Byte shifts: vshl/vshr move bits within 16-bit lanes (x86 has no byte shifts); every caller masks
 * the result to bits that came from the same byte, so the lane width never shows.
 */
#ifndef CONVEYOR_KQ_VEC_H
#define CONVEYOR_KQ_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define KQV static inline __attribute__((always_inline))

/* Before a loop over a block's 8 groups of codes: unrolled, g is a constant, so the prefetched lines and
 * the planes' offsets fold (Q3_K in cache 18 -> 31 GB/s a core). Not in the portable build (its lane loops
 * only grow: 5 minutes to compile with the sanitizers) nor the sanitizer build (the same C, rolled). */
#if KN_ISA != KN_ISA_PORTABLE && !defined(KN_SANITIZE)
#define KQ_UNROLL_GROUPS _Pragma("GCC unroll 8")
#else
#define KQ_UNROLL_GROUPS
#endif

static inline int32_t load_i32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

#if KN_ISA == KN_ISA_AVX512_VNNI
typedef __m512i v16i;
typedef __m512 v16f;
KQV v16i vload(const void *p) { return _mm512_loadu_si512(p); }
KQV v16i vzero(void) { return _mm512_setzero_si512(); }
KQV v16i vand8(v16i a, int m) { return _mm512_and_si512(a, _mm512_set1_epi8((char)m)); }
KQV v16i vor(v16i a, v16i b) { return _mm512_or_si512(a, b); }
KQV v16i vshift(v16i a, const int s) { return s > 0 ? _mm512_slli_epi16(a, s) : s < 0 ? _mm512_srli_epi16(a, -s) : a; }
KQV v16i vadd(v16i a, v16i b) { return _mm512_add_epi32(a, b); }
KQV v16i vsub(v16i a, v16i b) { return _mm512_sub_epi32(a, b); }
KQV v16i vmul(v16i a, v16i b) { return _mm512_mullo_epi32(a, b); }
KQV v16i vset(int32_t v) { return _mm512_set1_epi32(v); }
KQV v16i vu8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
KQV v16i vi8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* acc + per lane the dot of its 4 unsigned code bytes with the 4 signed bytes at x */
KQV v16i vdot(v16i acc, v16i codes, const int8_t *x) { return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(load_i32(x))); }
KQV v16i vdotw(v16i acc, v16i codes, const int8_t *x) { return vdot(acc, codes, x); }   /* codes up to 255 */
/* lo | hi << 16 per lane (both < 2^15): a pair of int16 for vdot16 */
KQV v16i vpair(v16i lo, v16i hi) { return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)); }
/* acc + per lane the dot of its two int16 with the two int16 of x (low, high) */
KQV v16i vdot16(v16i acc, v16i pairs, int32_t x) { return _mm512_dpwssd_epi32(acc, pairs, _mm512_set1_epi32(x)); }
/* each byte (< 16) -> table[byte] */
KQV v16i vlut(v16i idx, const uint8_t *table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)), idx);
}
KQV v16f vf16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
KQV v16f vcvt(v16i a) { return _mm512_cvtepi32_ps(a); }
KQV v16f vfset(float v) { return _mm512_set1_ps(v); }
KQV v16f vfmul(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
KQV v16f vfma(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }
KQV v16f vfms(v16f a, v16f b, v16f c) { return _mm512_fmsub_ps(a, b, c); }
KQV v16f vfload(const float *p) { return _mm512_loadu_ps(p); }
KQV void vfstore(float *p, v16f a) { _mm512_storeu_ps(p, a); }
KQV void vstore(void *p, v16i a) { _mm512_storeu_si512(p, a); }

#elif KN_ISA == KN_ISA_AVX2_VNNI || KN_ISA == KN_ISA_AVX2
typedef struct { __m256i a, b; } v16i;   /* lanes 0-7, 8-15 (bytes 0-31, 32-63) */
typedef struct { __m256 a, b; } v16f;
#define V2(expr_a, expr_b) ((v16i){expr_a, expr_b})
#define F2(expr_a, expr_b) ((v16f){expr_a, expr_b})
KQV v16i vload(const void *p) { return V2(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)); }
KQV v16i vzero(void) { return V2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
KQV v16i vand8(v16i x, int m) { const __m256i k = _mm256_set1_epi8((char)m); return V2(_mm256_and_si256(x.a, k), _mm256_and_si256(x.b, k)); }
KQV v16i vor(v16i x, v16i y) { return V2(_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)); }
KQV v16i vshift(v16i x, const int s) {
    if (s > 0) return V2(_mm256_slli_epi16(x.a, s), _mm256_slli_epi16(x.b, s));
    if (s < 0) return V2(_mm256_srli_epi16(x.a, -s), _mm256_srli_epi16(x.b, -s));
    return x;
}
KQV v16i vadd(v16i x, v16i y) { return V2(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
KQV v16i vsub(v16i x, v16i y) { return V2(_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)); }
KQV v16i vmul(v16i x, v16i y) { return V2(_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)); }
KQV v16i vset(int32_t v) { return V2(_mm256_set1_epi32(v), _mm256_set1_epi32(v)); }
KQV v16i vu8(const uint8_t *p) {
    return V2(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
KQV v16i vi8(const uint8_t *p) {
    return V2(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
KQV __m256i dot8(__m256i acc, __m256i codes, __m256i x) {
#if KN_ISA == KN_ISA_AVX2_VNNI && KN_VNNI256_EVEX
    return _mm256_dpbusd_epi32(acc, codes, x);
#elif KN_ISA == KN_ISA_AVX2_VNNI
    return _mm256_dpbusd_avx_epi32(acc, codes, x);
#else   /* codes <= 63, |x| <= 127: a pair's sum fits int16 without saturating */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
#endif
}
KQV v16i vdot(v16i acc, v16i codes, const int8_t *x) {
    const __m256i xb = _mm256_set1_epi32(load_i32(x));
    return V2(dot8(acc.a, codes.a, xb), dot8(acc.b, codes.b, xb));
}
KQV __m256i dot8w(__m256i acc, __m256i codes, __m256i x) {
#if KN_ISA == KN_ISA_AVX2_VNNI
    return dot8(acc, codes, x);
#else   /* codes up to 255: their top bit apart, so no pair's sum passes int16 */
    const __m256i top = _mm256_and_si256(codes, _mm256_set1_epi8((char)0x80)), ones = _mm256_set1_epi16(1);
    const __m256i lo = _mm256_maddubs_epi16(_mm256_xor_si256(codes, top), x), hi = _mm256_maddubs_epi16(top, x);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)));
#endif
}
KQV v16i vdotw(v16i acc, v16i codes, const int8_t *x) {
    const __m256i xb = _mm256_set1_epi32(load_i32(x));
    return V2(dot8w(acc.a, codes.a, xb), dot8w(acc.b, codes.b, xb));
}
KQV v16i vpair(v16i lo, v16i hi) {
    return V2(_mm256_or_si256(lo.a, _mm256_slli_epi32(hi.a, 16)), _mm256_or_si256(lo.b, _mm256_slli_epi32(hi.b, 16)));
}
KQV __m256i dot8_16(__m256i acc, __m256i pairs, __m256i x) {
#if KN_ISA == KN_ISA_AVX2_VNNI && KN_VNNI256_EVEX
    return _mm256_dpwssd_epi32(acc, pairs, x);
#elif KN_ISA == KN_ISA_AVX2_VNNI
    return _mm256_dpwssd_avx_epi32(acc, pairs, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, x));
#endif
}
KQV v16i vdot16(v16i acc, v16i pairs, int32_t x) {
    const __m256i xb = _mm256_set1_epi32(x);
    return V2(dot8_16(acc.a, pairs.a, xb), dot8_16(acc.b, pairs.b, xb));
}
KQV v16i vlut(v16i idx, const uint8_t *table) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    return V2(_mm256_shuffle_epi8(t, idx.a), _mm256_shuffle_epi8(t, idx.b));
}
KQV v16f vf16(const uint8_t *p) {
    return F2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
}
KQV v16f vcvt(v16i x) { return F2(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)); }
KQV v16f vfset(float v) { return F2(_mm256_set1_ps(v), _mm256_set1_ps(v)); }
KQV v16f vfmul(v16f x, v16f y) { return F2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
KQV v16f vfma(v16f x, v16f y, v16f z) { return F2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
KQV v16f vfms(v16f x, v16f y, v16f z) { return F2(_mm256_fmsub_ps(x.a, y.a, z.a), _mm256_fmsub_ps(x.b, y.b, z.b)); }
KQV v16f vfload(const float *p) { return F2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
KQV void vfstore(float *p, v16f x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
KQV void vstore(void *p, v16i x) { _mm256_storeu_si256((__m256i *)p, x.a); _mm256_storeu_si256((__m256i *)p + 1, x.b); }

#else
typedef union { int32_t i[16]; uint8_t b[64]; } v16i;
typedef struct { float f[16]; } v16f;
#define LANES(e) for (int l_ = 0; l_ < 16; l_++) { const int l = l_; e; }
KQV v16i vload(const void *p) { v16i r; memcpy(r.b, p, 64); return r; }
KQV v16i vzero(void) { v16i r; memset(&r, 0, sizeof r); return r; }
KQV v16i vand8(v16i x, int m) { for (int i = 0; i < 64; i++) x.b[i] &= (uint8_t)m; return x; }
KQV v16i vor(v16i x, v16i y) { LANES(x.i[l] |= y.i[l]) return x; }
KQV v16i vshift(v16i x, const int s) {   /* per byte: callers mask to bits of the same byte */
    for (int i = 0; i < 64; i++) x.b[i] = (uint8_t)(s >= 0 ? x.b[i] << s : x.b[i] >> -s);
    return x;
}
KQV v16i vadd(v16i x, v16i y) { LANES(x.i[l] += y.i[l]) return x; }
KQV v16i vsub(v16i x, v16i y) { LANES(x.i[l] -= y.i[l]) return x; }
KQV v16i vmul(v16i x, v16i y) { LANES(x.i[l] *= y.i[l]) return x; }
KQV v16i vset(int32_t v) { v16i r; LANES(r.i[l] = v) return r; }
KQV v16i vu8(const uint8_t *p) { v16i r; LANES(r.i[l] = p[l]) return r; }
KQV v16i vi8(const uint8_t *p) { v16i r; LANES(r.i[l] = (int8_t)p[l]) return r; }
KQV v16i vdot(v16i acc, v16i c, const int8_t *x) {
    LANES(acc.i[l] += c.b[4 * l] * x[0] + c.b[4 * l + 1] * x[1] + c.b[4 * l + 2] * x[2] + c.b[4 * l + 3] * x[3])
    return acc;
}
KQV v16i vdotw(v16i acc, v16i codes, const int8_t *x) { return vdot(acc, codes, x); }
KQV v16i vpair(v16i lo, v16i hi) { LANES(lo.i[l] = (int32_t)((uint32_t)lo.i[l] | (uint32_t)hi.i[l] << 16)) return lo; }
KQV v16i vdot16(v16i acc, v16i p, int32_t x) {
    LANES(acc.i[l] += (int16_t)(p.i[l] & 0xffff) * (int16_t)(x & 0xffff) + (int16_t)((uint32_t)p.i[l] >> 16) * (int16_t)((uint32_t)x >> 16))
    return acc;
}
KQV v16i vlut(v16i idx, const uint8_t *table) { for (int i = 0; i < 64; i++) idx.b[i] = table[idx.b[i] & 15]; return idx; }
KQV v16f vf16(const uint8_t *p) { v16f r; uint16_t h[16]; memcpy(h, p, 32); LANES(r.f[l] = f16_to_f32(h[l])) return r; }
KQV v16f vcvt(v16i x) { v16f r; LANES(r.f[l] = (float)x.i[l]) return r; }
KQV v16f vfset(float v) { v16f r; LANES(r.f[l] = v) return r; }
KQV v16f vfmul(v16f x, v16f y) { LANES(x.f[l] *= y.f[l]) return x; }
KQV v16f vfma(v16f x, v16f y, v16f z) { LANES(z.f[l] = fmaf(x.f[l], y.f[l], z.f[l])) return z; }
KQV v16f vfms(v16f x, v16f y, v16f z) { LANES(z.f[l] = fmaf(x.f[l], y.f[l], -z.f[l])) return z; }
KQV v16f vfload(const float *p) { v16f r; memcpy(r.f, p, 64); return r; }
KQV void vfstore(float *p, v16f x) { memcpy(p, x.f, 64); }
KQV void vstore(void *p, v16i x) { memcpy(p, x.b, 64); }
#endif

#endif
