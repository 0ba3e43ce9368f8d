/* The AVX-512F intrinsics our kernels use, on CPUs with AVX2, FMA and F16C only (EPYC Milan and older,
 * pre-Skylake-SP Xeons): a 16-lane vector is two 8-lane halves and a 16-bit mask picks lanes of both.
 *
 * Where the compiler targets AVX-512F this header is empty, so the AVX-512 builds are untouched.
 * Elsewhere the kernels' own source compiles unchanged against it (the build adds -mavx2 -mfma
 * -mf16c): each _mm512_* name below is redefined to a function on the two halves, computing what the
 * AVX-512 instruction computes lane for lane. Horizontal sums add the halves first, so a sum may
 * round differently in its last bit from the AVX-512 build; everything else is exact.
 */
#ifndef XLLM_AVX512_ON_AVX2_H
#define XLLM_AVX512_ON_AVX2_H

#ifndef __AVX512F__

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    __m256 lo, hi;
} x16f;
typedef struct {
    __m256i lo, hi;
} x16i;
typedef uint16_t x16mask;

#define X16_INLINE static inline __attribute__((always_inline))

/* lanes of an 8-bit mask as an all-ones / zero vector */
X16_INLINE __m256i x16_lanes8(unsigned k) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)k), bit), bit);
}
X16_INLINE __m256 x16_lanes8_ps(unsigned k) { return _mm256_castsi256_ps(x16_lanes8(k)); }

/* float32 arithmetic */
X16_INLINE x16f x16_set1_ps(float a) { return (x16f){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
X16_INLINE x16f x16_setzero_ps(void) { return (x16f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
X16_INLINE x16f x16_loadu_ps(const void *p) {
    return (x16f){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)};
}
X16_INLINE void x16_storeu_ps(void *p, x16f v) {
    _mm256_storeu_ps((float *)p, v.lo);
    _mm256_storeu_ps((float *)p + 8, v.hi);
}
#define X16_BINARY(name, op)                                                            \
    X16_INLINE x16f name(x16f a, x16f b) { return (x16f){op(a.lo, b.lo), op(a.hi, b.hi)}; }
X16_BINARY(x16_add_ps, _mm256_add_ps)
X16_BINARY(x16_sub_ps, _mm256_sub_ps)
X16_BINARY(x16_mul_ps, _mm256_mul_ps)
X16_BINARY(x16_div_ps, _mm256_div_ps)
X16_BINARY(x16_max_ps, _mm256_max_ps)
X16_BINARY(x16_min_ps, _mm256_min_ps)
#undef X16_BINARY
X16_INLINE x16f x16_fmadd_ps(x16f a, x16f b, x16f c) {
    return (x16f){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
X16_INLINE x16f x16_fnmadd_ps(x16f a, x16f b, x16f c) {
    return (x16f){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
X16_INLINE x16f x16_abs_ps(x16f a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return (x16f){_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
/* only the rounding modes of _mm256_round_ps (scale 0), which is all the kernels ask */
#define x16_roundscale_ps(a, imm)                                                                   \
    __extension__({                                                                                \
        const x16f _a = (a);                                                                       \
        (x16f){_mm256_round_ps(_a.lo, (imm) & 0x0F), _mm256_round_ps(_a.hi, (imm) & 0x0F)};        \
    })
/* a * 2^n for integral n in [-126, 127] (vec_exp's range) */
X16_INLINE x16f x16_scalef_ps(x16f a, x16f n) {
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.lo), bias), 23));
    const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.hi), bias), 23));
    return (x16f){_mm256_mul_ps(a.lo, lo), _mm256_mul_ps(a.hi, hi)};
}
/* the 16 lanes folded with op (add, max): halves, then 128-bit halves, then pairs */
#define X16_REDUCE(name, op)                                                                       \
    X16_INLINE float name(x16f a) {                                                                \
        const __m256 s = _mm256_##op##_ps(a.lo, a.hi);                                             \
        __m128 t = _mm_##op##_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));          \
        t = _mm_##op##_ps(t, _mm_movehl_ps(t, t));                                                 \
        return _mm_cvtss_f32(_mm_##op##_ss(t, _mm_movehdup_ps(t)));                                \
    }
X16_REDUCE(x16_reduce_add_ps, add)
X16_REDUCE(x16_reduce_max_ps, max)
#undef X16_REDUCE

/* masks */
#define x16_cmp_ps_mask(a, b, imm)                                                                 \
    __extension__({                                                                                \
        const x16f _a = (a), _b = (b);                                                             \
        (x16mask)(_mm256_movemask_ps(_mm256_cmp_ps(_a.lo, _b.lo, (imm))) |                         \
                  (_mm256_movemask_ps(_mm256_cmp_ps(_a.hi, _b.hi, (imm))) << 8));                  \
    })
#define x16_mask_cmp_ps_mask(k, a, b, imm) ((x16mask)((k) & x16_cmp_ps_mask(a, b, imm)))
X16_INLINE x16f x16_mask_mov_ps(x16f src, x16mask k, x16f a) {
    return (x16f){_mm256_blendv_ps(src.lo, a.lo, x16_lanes8_ps(k & 0xFF)),
                  _mm256_blendv_ps(src.hi, a.hi, x16_lanes8_ps(k >> 8))};
}
X16_INLINE x16f x16_maskz_mov_ps(x16mask k, x16f a) {
    return (x16f){_mm256_and_ps(a.lo, x16_lanes8_ps(k & 0xFF)), _mm256_and_ps(a.hi, x16_lanes8_ps(k >> 8))};
}
/* masked loads and stores touch no memory in the lanes the mask leaves out (as AVX-512's) */
X16_INLINE x16f x16_maskz_loadu_ps(x16mask k, const void *p) {
    return (x16f){_mm256_maskload_ps((const float *)p, x16_lanes8(k & 0xFF)),
                  _mm256_maskload_ps((const float *)p + 8, x16_lanes8(k >> 8))};
}
X16_INLINE x16f x16_mask_loadu_ps(x16f src, x16mask k, const void *p) {
    return x16_mask_mov_ps(src, k, x16_maskz_loadu_ps(k, p));
}
X16_INLINE void x16_mask_storeu_ps(void *p, x16mask k, x16f v) {
    _mm256_maskstore_ps((float *)p, x16_lanes8(k & 0xFF), v.lo);
    _mm256_maskstore_ps((float *)p + 8, x16_lanes8(k >> 8), v.hi);
}

/* int32 lanes */
X16_INLINE x16i x16_set1_epi32(int a) { return (x16i){_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
X16_INLINE x16i x16_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9,
                               int a10, int a11, int a12, int a13, int a14, int a15) {
    return (x16i){_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7),
                  _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}
#define X16_IBINARY(name, op)                                                           \
    X16_INLINE x16i name(x16i a, x16i b) { return (x16i){op(a.lo, b.lo), op(a.hi, b.hi)}; }
X16_IBINARY(x16_add_epi32, _mm256_add_epi32)
X16_IBINARY(x16_sub_epi32, _mm256_sub_epi32)
X16_IBINARY(x16_and_si512, _mm256_and_si256)
X16_IBINARY(x16_or_si512, _mm256_or_si256)
#undef X16_IBINARY
X16_INLINE x16i x16_srli_epi32(x16i a, unsigned n) {
    return (x16i){_mm256_srli_epi32(a.lo, (int)n), _mm256_srli_epi32(a.hi, (int)n)};
}
X16_INLINE x16i x16_slli_epi32(x16i a, unsigned n) {
    return (x16i){_mm256_slli_epi32(a.lo, (int)n), _mm256_slli_epi32(a.hi, (int)n)};
}
X16_INLINE x16f x16_castsi512_ps(x16i a) { return (x16f){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
X16_INLINE x16i x16_castps_si512(x16f a) { return (x16i){_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
X16_INLINE x16i x16_cvtps_epi32(x16f a) { return (x16i){_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
X16_INLINE x16f x16_cvtepi32_ps(x16i a) { return (x16f){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
X16_INLINE x16i x16_mask_mov_epi32(x16i src, x16mask k, x16i a) {
    return (x16i){_mm256_blendv_epi8(src.lo, a.lo, x16_lanes8(k & 0xFF)),
                  _mm256_blendv_epi8(src.hi, a.hi, x16_lanes8(k >> 8))};
}
X16_INLINE x16i x16_mask_blend_epi32(x16mask k, x16i a, x16i b) { return x16_mask_mov_epi32(a, k, b); }
X16_INLINE void x16_storeu_si512(void *p, x16i v) {
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)p + 1, v.hi);
}

/* widening and narrowing */
X16_INLINE x16i x16_cvtepu16_epi32(__m256i a) { /* 16 uint16 -> int32 */
    return (x16i){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
X16_INLINE x16i x16_cvtepi8_epi32(__m128i a) { /* 16 int8 -> int32 */
    return (x16i){_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))};
}
X16_INLINE x16f x16_cvtph_ps(__m256i a) { /* 16 float16 -> float32 */
    return (x16f){_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}
X16_INLINE __m256i x16_cvtepi32_epi16(x16i a) { /* truncating, as vpmovdw */
    int32_t w[16];
    int16_t r[16];
    x16_storeu_si512(w, a);
    for (int i = 0; i < 16; i++) r[i] = (int16_t)w[i];
    return _mm256_loadu_si256((const __m256i *)r);
}
X16_INLINE __m128i x16_cvtepi32_epi8(x16i a) { /* truncating, as vpmovdb */
    int32_t w[16];
    int8_t r[16];
    x16_storeu_si512(w, a);
    for (int i = 0; i < 16; i++) r[i] = (int8_t)w[i];
    return _mm_loadu_si128((const __m128i *)r);
}
X16_INLINE void x16_mask_cvtepi32_storeu_epi16(void *p, x16mask k, x16i a) {
    int32_t w[16];
    x16_storeu_si512(w, a);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) ((int16_t *)p)[i] = (int16_t)w[i];
}

/* The kernels' names, from here on (some are macros in the compiler's own header). */
#undef __m512
#define __m512 x16f
#undef __m512i
#define __m512i x16i
#undef __mmask16
#define __mmask16 x16mask
#undef _mm512_set1_ps
#define _mm512_set1_ps x16_set1_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps x16_setzero_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps x16_loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps x16_storeu_ps
#undef _mm512_add_ps
#define _mm512_add_ps x16_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps x16_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps x16_mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps x16_div_ps
#undef _mm512_max_ps
#define _mm512_max_ps x16_max_ps
#undef _mm512_min_ps
#define _mm512_min_ps x16_min_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps x16_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps x16_fnmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps x16_abs_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps x16_roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps x16_scalef_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps x16_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps x16_reduce_max_ps
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask x16_cmp_ps_mask
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask x16_mask_cmp_ps_mask
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps x16_mask_mov_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps x16_maskz_mov_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps x16_maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps x16_mask_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps x16_mask_storeu_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 x16_set1_epi32
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 x16_setr_epi32
#undef _mm512_add_epi32
#define _mm512_add_epi32 x16_add_epi32
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 x16_sub_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 x16_and_si512
#undef _mm512_or_si512
#define _mm512_or_si512 x16_or_si512
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 x16_srli_epi32
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 x16_slli_epi32
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps x16_castsi512_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 x16_castps_si512
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 x16_cvtps_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps x16_cvtepi32_ps
#undef _mm512_mask_mov_epi32
#define _mm512_mask_mov_epi32 x16_mask_mov_epi32
#undef _mm512_mask_blend_epi32
#define _mm512_mask_blend_epi32 x16_mask_blend_epi32
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 x16_storeu_si512
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 x16_cvtepu16_epi32
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 x16_cvtepi8_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps x16_cvtph_ps
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 x16_cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 x16_cvtepi32_epi8
#undef _mm512_mask_cvtepi32_storeu_epi16
#define _mm512_mask_cvtepi32_storeu_epi16 x16_mask_cvtepi32_storeu_epi16

#endif /* __AVX512F__ */
#endif
