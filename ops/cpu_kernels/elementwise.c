/* Row-wise elementwise ops of a decoder layer in one pass each: RMSNorm (optionally fused with the
 * residual add), the SwiGLU gate silu(gate) * up, and NeoX rotary embedding of q and k.
 *
 * In eager mode each of these is several torch ops (pow, mean, add, rsqrt, mul, mul; silu, mul;
 * four muls and two adds), each a pass over memory and a dispatch. Here each is one pass per row,
 * rows split over OpenMP threads when there are enough of them. Every row is computed the same way
 * whatever the row count: a token's result does not depend on its batch.
 *
 * float32 or bfloat16 (the *_bf16 functions: float32 inside, each result rounded once to nearest even),
 * AVX-512F; rows of a tensor may be strided, elements within a row are contiguous.
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

/* Rows of float32 or (BF16, a constant in each copy) bfloat16 elements: p is void * at element 0. */
#define AT(p, i) ((char *)(p) + (i) * (BF16 ? 2 : 4))

/* 16 elements (n == 16) or the first n < 16 (zeros after) at p, as float32. */
static inline __attribute__((always_inline)) __m512 load16(const int BF16, const void *p, int64_t n) {
    if (BF16) return n == 16 ? bf16_loadu(p) : bf16_loadu_n(p, n);
    return n == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}

/* The first n <= 16 lanes of v to p (bfloat16: rounded to nearest even). */
static inline __attribute__((always_inline)) void store16(const int BF16, void *p, __m512 v, int64_t n) {
    if (BF16)
        n == 16 ? bf16_storeu(p, v) : bf16_storeu_n(p, v, n);
    else if (n == 16)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}

/* out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * w for the rows r = (o, i) of x, o < outer, i < inner,
 * at x + o * x_so + i * x_si (a [T, heads, n] view of a fused projection: outer T, inner heads); out
 * is contiguous [outer * inner, n]. With residual (same shape, its own strides): x[r] += residual[r]
 * first (x is the new residual stream then). bfloat16 (x, residual, w, out all bfloat16): float32
 * inside; the sum is rounded to bfloat16 when stored and the statistics use the stored sum, as
 * torch's bfloat16 add followed by the norm; out is rounded once. */
static inline __attribute__((always_inline)) void rms_norm_rows(
    const int BF16, void *x, int64_t outer, int64_t inner, int64_t x_so, int64_t x_si, const void *residual,
    int64_t r_so, int64_t r_si, const void *w, void *out, int64_t n, float eps, int nthreads) {
    const int64_t vec = n & ~(int64_t)15, rows = outer * inner, rest = n - vec;
#pragma omp parallel for num_threads(threads_for(rows * n, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r / inner, i = r % inner;
        void *xr = AT(x, o * x_so + i * x_si);
        const void *rr = residual ? AT(residual, o * r_so + i * r_si) : 0;
        void *orow = AT(out, r * n);
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j < vec; j += 16) {
            __m512 v = load16(BF16, AT(xr, j), 16);
            if (residual) {
                v = _mm512_add_ps(v, load16(BF16, AT(rr, j), 16));
                if (BF16) v = bf16_round_ps(v);
                store16(BF16, AT(xr, j), v, 16);
            }
            if ((j >> 4) & 1)
                s1 = _mm512_fmadd_ps(v, v, s1);
            else
                s0 = _mm512_fmadd_ps(v, v, s0);
        }
        if (rest) {
            __m512 v = load16(BF16, AT(xr, j), rest);
            if (residual) {
                v = _mm512_add_ps(v, load16(BF16, AT(rr, j), rest));
                if (BF16) v = bf16_round_ps(v);
                store16(BF16, AT(xr, j), v, rest);
            }
            s0 = _mm512_fmadd_ps(v, v, s0);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / (float)n + eps);
        const __m512 vinv = _mm512_set1_ps(inv);
        for (j = 0; j < vec; j += 16)
            store16(BF16, AT(orow, j),
                    _mm512_mul_ps(_mm512_mul_ps(load16(BF16, AT(xr, j), 16), vinv), load16(BF16, AT(w, j), 16)), 16);
        if (rest)
            store16(BF16, AT(orow, j),
                    _mm512_mul_ps(_mm512_mul_ps(load16(BF16, AT(xr, j), rest), vinv), load16(BF16, AT(w, j), rest)),
                    rest);
    }
}

void xllm_rms_norm(float *x, int64_t outer, int64_t inner, int64_t x_so, int64_t x_si, const float *residual,
                   int64_t r_so, int64_t r_si, const float *w, float *out, int64_t n, float eps, int nthreads) {
    rms_norm_rows(0, x, outer, inner, x_so, x_si, residual, r_so, r_si, w, out, n, eps, nthreads);
}

void xllm_rms_norm_bf16(uint16_t *x, int64_t outer, int64_t inner, int64_t x_so, int64_t x_si,
                        const uint16_t *residual, int64_t r_so, int64_t r_si, const uint16_t *w, uint16_t *out,
                        int64_t n, float eps, int nthreads) {
    rms_norm_rows(1, x, outer, inner, x_so, x_si, residual, r_so, r_si, w, out, n, eps, nthreads);
}

static inline __m512 silu_mul(__m512 g, __m512 u) {
    const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                     _mm512_add_ps(_mm512_set1_ps(1.0f), vec_exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

/* out[r, :n] = silu(x[r, :n]) * x[r, n:2n] (bfloat16: float32 inside, rounded once) */
static inline __attribute__((always_inline)) void silu_and_mul_rows(const int BF16, const void *x, int64_t x_stride,
                                                                    void *out, int64_t out_stride, int64_t rows,
                                                                    int64_t n, int nthreads) {
    const int64_t vec = n & ~(int64_t)15, rest = n - vec;
#pragma omp parallel for num_threads(threads_for(rows * n * 4, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const void *g = AT(x, r * x_stride), *u = AT(g, n);
        void *o = AT(out, r * out_stride);
        int64_t j = 0;
        for (; j < vec; j += 16)
            store16(BF16, AT(o, j), silu_mul(load16(BF16, AT(g, j), 16), load16(BF16, AT(u, j), 16)), 16);
        if (rest)
            store16(BF16, AT(o, j), silu_mul(load16(BF16, AT(g, j), rest), load16(BF16, AT(u, j), rest)), rest);
    }
}

void xllm_silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows,
                       int64_t n, int nthreads) {
    silu_and_mul_rows(0, x, x_stride, out, out_stride, rows, n, nthreads);
}

void xllm_silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                            int64_t n, int nthreads) {
    silu_and_mul_rows(1, x, x_stride, out, out_stride, rows, n, nthreads);
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

/* rotate_head for bfloat16 x and o (cos/sin float32): float32 inside, each result rounded once. */
static inline void rotate_head_bf16(const uint16_t *x, uint16_t *o, const float *c, const float *s, int64_t half) {
    for (int64_t j = 0; j < half; j += 16) {
        const int64_t n = half - j < 16 ? half - j : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        const __m512 x1 = n == 16 ? bf16_loadu(x + j) : bf16_loadu_n(x + j, n);
        const __m512 x2 = n == 16 ? bf16_loadu(x + half + j) : bf16_loadu_n(x + half + j, n);
        const __m512 cv = _mm512_maskz_loadu_ps(m, c + j), sv = _mm512_maskz_loadu_ps(m, s + j);
        const __m512 r1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
        const __m512 r2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
        if (n == 16) {
            bf16_storeu(o + j, r1);
            bf16_storeu(o + half + j, r2);
        } else {
            bf16_storeu_n(o + j, r1, n);
            bf16_storeu_n(o + half + j, r2, n);
        }
    }
}

/* xllm_rope_neox for bfloat16 q, k, q_out and k_out; cos_sin stays float32 (the model's cache). */
void xllm_rope_neox_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                         const int64_t *positions, const float *cos_sin, int64_t cs_stride, uint16_t *q_out,
                         uint16_t *k_out, int64_t tokens, int64_t hq, int64_t hk, int64_t dim, int nthreads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens * (hq + hk) * dim, nthreads)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * cs_stride, *s = c + half;
        for (int64_t h = 0; h < hq; h++)
            rotate_head_bf16(q + t * q_stride + h * dim, q_out + (t * hq + h) * dim, c, s, half);
        for (int64_t h = 0; h < hk; h++)
            rotate_head_bf16(k + t * k_stride + h * dim, k_out + (t * hk + h) * dim, c, s, half);
    }
}
