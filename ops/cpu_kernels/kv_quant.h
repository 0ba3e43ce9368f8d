/* 8-bit KV cache rows (ops/kv_quant.py is the format and its torch reference): a (token, KV head)
 * row is dim 8-bit values followed by its float32 scale, value = q * scale. int8: symmetric,
 * scale = amax / 127, q = round(x / scale) half to even; fp8: e4m3fn bits, scale = amax / 448,
 * q = fp8(x / scale) nearest even. A row of zeros gets scale 1. The arithmetic is the reference's,
 * operation for operation, so both write the same bytes.
 */
#ifndef XLLM_KV_QUANT_H
#define XLLM_KV_QUANT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* 16 int8 values as float32. */
static inline __m512 int8_loadu(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 fp8 e4m3fn values as float32, each divided by 256: e4m3's bits moved into a float16 (sign to
 * bit 15, exponent and mantissa to bits 13..7) are the value times 2^-8, exact for subnormals too, and
 * the hardware widens float16 exactly. Sign-extended to 16 bits and shifted left by 7, the byte's sign
 * lands on bits 14 and 15: clearing bit 14 leaves the float16. Callers fold the 256 into the row's
 * scale. */
static inline __m512 fp8_loadu_div256(const uint8_t *p) {
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16((short)0xBFFF)));
}

/* The scale stored after a row's dim values. */
static inline float q8_row_scale(const uint8_t *row, int64_t dim) {
    float s;
    memcpy(&s, row + dim, sizeof(float));
    return s;
}

/* fp8 e4m3fn bits (in the low byte of each lane) of 16 float32 values, clamped to +-448 first. */
static inline __m512i fp8_bits(__m512 y) {
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m512i u = _mm512_castps_si512(y);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    /* from 2^-6 up: the mantissa rounded to 3 bits (nearest even), the exponent rebiased by 7 - 127 */
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), odd);
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
    /* below 2^-6 (subnormal e4m3): the nearest even multiple of 2^-9 */
    const __m512 af = _mm512_castsi512_ps(a);
    const __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(af, _mm512_set1_ps(512.0f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 small = _mm512_cmp_ps_mask(af, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
    return _mm512_or_si512(sign, _mm512_mask_blend_epi32(small, normal, _mm512_cvtps_epi32(m)));
}

/* 16 source values at element j of a float32 (src_bf16: bfloat16) row. */
static inline __m512 q8_load_src(const void *src, int src_bf16, int64_t j) {
    return src_bf16 ? bf16_loadu((const uint16_t *)src + j) : _mm512_loadu_ps((const float *)src + j);
}

/* One row of dim (a multiple of 16) values as dim 8-bit values and the float32 scale at dst. */
static inline void quantize_row(const void *src, int src_bf16, int fp8, int64_t dim, uint8_t *dst) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t j = 0; j < dim; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(q8_load_src(src, src_bf16, j)));
    float s = _mm512_reduce_max_ps(mx) / (fp8 ? 448.0f : 127.0f);
    if (!(s > 0.0f)) s = 1.0f;
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t j = 0; j < dim; j += 16) {
        const __m512 y = _mm512_div_ps(q8_load_src(src, src_bf16, j), sv);
        __m512i r;
        if (fp8) {
            r = fp8_bits(y);
        } else {
            const __m512 q = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)));
        }
        _mm_storeu_si128((__m128i *)(dst + j), _mm512_cvtepi32_epi8(r));
    }
    memcpy(dst + dim, &s, sizeof(float));
}

#endif
