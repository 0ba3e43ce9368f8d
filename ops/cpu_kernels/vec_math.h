/* Vector math shared by the CPU kernels (AVX-512F, float32), and bfloat16 <-> float32 conversion. */
#ifndef XLLM_VEC_MATH_H
#define XLLM_VEC_MATH_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx512_on_avx2.h"

/* e^x to about 1 ulp over [-87, 88] (inputs clamped there: 0 and +inf are not reached): x = n ln2 + r,
 * a degree-6 polynomial of r (Cody-Waite split of ln2, the coefficients of Cephes' expf), times 2^n. */
static inline __m512 vec_exp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* bfloat16 is the top half of a float32. These use AVX-512F integer ops only (no AVX512-BF16, which
 * some of our machines lack, and no AVX512-BW): widening is a zero-extend and a 16-bit shift;
 * narrowing rounds to nearest even (add 0x7fff plus the kept part's lowest bit, then shift), the
 * rounding torch's own conversion does, and maps every NaN to torch's quiet NaN 0x7fc0. */

static inline __m512 bf16_loadu(const uint16_t *p) { /* 16 values */
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __m512 bf16_loadu_n(const uint16_t *p, int64_t n) { /* the first n < 16, zeros after */
    uint16_t buf[16] = {0}; /* a masked 16-bit load would need AVX512-BW */
    memcpy(buf, p, sizeof(uint16_t) * (size_t)n);
    return bf16_loadu(buf);
}

static inline __m512i bf16_bits(__m512 v) { /* each lane's bfloat16 (round to nearest even) */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

static inline __m512 bf16_round_ps(__m512 v) { /* v rounded to bfloat16, as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

static inline void bf16_storeu(uint16_t *p, __m512 v) { /* 16 values */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

static inline void bf16_storeu_n(uint16_t *p, __m512 v, int64_t n) { /* the first n < 16 */
    _mm512_mask_cvtepi32_storeu_epi16(p, (__mmask16)((1u << n) - 1), bf16_bits(v));
}

#endif
