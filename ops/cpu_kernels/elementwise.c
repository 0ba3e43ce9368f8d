/* Row-wise elementwise ops of a decoder layer in one pass each: RMSNorm (optionally fused with the
 * residual add), the SwiGLU gate silu(gate) * up, and NeoX rotary embedding of q and k.
 *
 * In eager mode each of these is several torch ops (pow, mean, add, rsqrt, mul, mul; silu, mul;
 * four muls and two adds), each a pass over memory and a dispatch. Here each is one pass per row,
 * rows split over OpenMP threads when there are enough of them. Every row is computed the same way
 * whatever the row count: a token's result does not depend on its batch.
 *
 * float32, AVX-512F; rows of a tensor may be strided, elements within a row are contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vec_math.h"

#define PARALLEL_MIN_FLOATS (1 << 15) /* below this much work one thread does it all */

static inline int threads_for(int64_t floats, int nthreads) {
    return floats >= PARALLEL_MIN_FLOATS && nthreads > 1 ? nthreads : 1;
}

/* out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * w for the rows r = (o, i) of x, o < outer, i < inner,
 * at x + o * x_so + i * x_si (a [T, heads, n] view of a fused projection: outer T, inner heads); out
 * is contiguous [outer * inner, n]. With residual (same shape, its own strides): x[r] += residual[r]
 * first (x is the new residual stream then). */
void xllm_rms_norm(float *x, int64_t outer, int64_t inner, int64_t x_so, int64_t x_si, const float *residual,
                   int64_t r_so, int64_t r_si, const float *w, float *out, int64_t n, float eps, int nthreads) {
    const int64_t vec = n & ~(int64_t)15, rows = outer * inner;
    const __mmask16 tail = (__mmask16)((1u << (n - vec)) - 1);
#pragma omp parallel for num_threads(threads_for(rows * n, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r / inner, i = r % inner;
        float *xr = x + o * x_so + i * x_si;
        const float *rr = residual ? residual + o * r_so + i * r_si : 0;
        float *orow = out + r * n;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j < vec; j += 16) {
            __m512 v = _mm512_loadu_ps(xr + j);
            if (residual) {
                v = _mm512_add_ps(v, _mm512_loadu_ps(rr + j));
                _mm512_storeu_ps(xr + j, v);
            }
            if ((j >> 4) & 1)
                s1 = _mm512_fmadd_ps(v, v, s1);
            else
                s0 = _mm512_fmadd_ps(v, v, s0);
        }
        if (tail) {
            __m512 v = _mm512_maskz_loadu_ps(tail, xr + j);
            if (residual) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(tail, rr + j));
                _mm512_mask_storeu_ps(xr + j, tail, v);
            }
            s0 = _mm512_fmadd_ps(v, v, s0);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / (float)n + eps);
        const __m512 vinv = _mm512_set1_ps(inv);
        for (j = 0; j < vec; j += 16)
            _mm512_storeu_ps(orow + j,
                             _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + j), vinv), _mm512_loadu_ps(w + j)));
        if (tail)
            _mm512_mask_storeu_ps(orow + j, tail,
                                  _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + j), vinv),
                                                _mm512_maskz_loadu_ps(tail, w + j)));
    }
}

static inline __m512 silu_mul(__m512 g, __m512 u) {
    const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                     _mm512_add_ps(_mm512_set1_ps(1.0f), vec_exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

/* out[r, :n] = silu(x[r, :n]) * x[r, n:2n] */
void xllm_silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows,
                       int64_t n, int nthreads) {
    const int64_t vec = n & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (n - vec)) - 1);
#pragma omp parallel for num_threads(threads_for(rows * n * 4, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * out_stride;
        int64_t j = 0;
        for (; j < vec; j += 16) _mm512_storeu_ps(o + j, silu_mul(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
        if (tail)
            _mm512_mask_storeu_ps(o + j, tail,
                                  silu_mul(_mm512_maskz_loadu_ps(tail, g + j), _mm512_maskz_loadu_ps(tail, u + j)));
    }
}

/* NeoX rotation of one head (dim = 2 * half) by cos/sin [half]: out = [x1 c - x2 s, x2 c + x1 s]. */
static inline void rotate_head(const float *x, float *o, const float *c, const float *s, int64_t half) {
    int64_t j = 0;
    for (; j + 16 <= half; j += 16) {
        const __m512 x1 = _mm512_loadu_ps(x + j), x2 = _mm512_loadu_ps(x + half + j);
        const __m512 cv = _mm512_loadu_ps(c + j), sv = _mm512_loadu_ps(s + j);
        _mm512_storeu_ps(o + j, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)));
        _mm512_storeu_ps(o + half + j, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)));
    }
    for (; j < half; j++) {
        const float x1 = x[j], x2 = x[half + j];
        o[j] = x1 * c[j] - x2 * s[j];
        o[half + j] = x2 * c[j] + x1 * s[j];
    }
}

/* q [T, hq, dim] (token stride q_stride, heads contiguous), k likewise; cos_sin [P, dim] = [cos | sin]
 * per position; q_out / k_out contiguous [T, h, dim]. */
void xllm_rope_neox(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const int64_t *positions,
                    const float *cos_sin, int64_t cs_stride, float *q_out, float *k_out, int64_t tokens, int64_t hq,
                    int64_t hk, int64_t dim, int nthreads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens * (hq + hk) * dim, nthreads)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * cs_stride, *s = c + half;
        for (int64_t h = 0; h < hq; h++) rotate_head(q + t * q_stride + h * dim, q_out + (t * hq + h) * dim, c, s, half);
        for (int64_t h = 0; h < hk; h++) rotate_head(k + t * k_stride + h * dim, k_out + (t * hk + h) * dim, c, s, half);
    }
}
