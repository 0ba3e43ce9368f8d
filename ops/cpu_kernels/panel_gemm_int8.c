/* W8A8 int8 GEMM on the CPU's int8 dot-product unit (AVX512_VNNI ``vpdpbusd``), int32 accumulation:
 * out[M, N] = (sx[M] x sw[N]) * (xq[M, K] @ wq[N, K]^T) (+ bias), with
 * - wq: the weight rounded per output channel to int8 (symmetric, sw = max |w| / 127), packed in
 *   32-column panels of k quads: [ceil(K / 4)][32][4] int8, one zmm = 16 columns x 4 k;
 * - xq: each row of x rounded to int8 per token, dynamically, as it is packed (sx = max |x| / 127,
 *   nearest even), stored + 128 as uint8 quads [ceil(K / 4)][12] per row block of 12.
 * ``vpdpbusd`` multiplies 4 unsigned x bytes by 4 signed weight bytes and adds the sum to an int32
 * lane; the + 128 is taken back out with the column sums of wq (128 * colsum, computed when packed).
 * Four k per instruction: twice the bf16 unit's products per instruction, a quarter of float32's bytes.
 *
 * The integer sums are exact, so a row's result does not depend on its batch, the row block or the
 * thread. x float32 or bf16; out float32 or bf16 (rounded once); bias float32.
 *
 * Needs AVX-512F/BW/VL and AVX512_VNNI (build.py builds it only where the CPU has them).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 32
#define MR 12
#define L2_PANEL_BYTES (1 << 20)
#define PARALLEL_MIN_MACS (16 << 20)

int xllm_panel_gemm_int8_abi(void) { return 1; }

static inline float load_f(const void *src, int is_bf16, int64_t i) {
    if (!is_bf16) return ((const float *)src)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)src)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* W [n, k] (float32 or bf16; (j, kk) at w[j * stride_n + kk * stride_k]) -> int8 panels
 * [ceil(n / 32)][ceil(k / 4)][32][4], per-column scales [n] and 128 * column sums [panels * 32]. */
void xllm_panel_pack_int8(const void *w, int w_bf16, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k,
                          int8_t *packed, float *scales, int32_t *comp) {
    const int64_t panels = (n + NR - 1) / NR, k4 = (k + 3) / 4;
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = packed + p * k4 * NR * 4;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t col = p * NR + j;
            float amax = 0.0f;
            if (col < n)
                for (int64_t kk = 0; kk < k; kk++) amax = fmaxf(amax, fabsf(load_f(w, w_bf16, col * stride_n + kk * stride_k)));
            const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
            if (col < n) scales[col] = scale;
            int32_t sum = 0;
            for (int64_t kk = 0; kk < 4 * k4; kk++) {
                int8_t q = 0;
                if (col < n && kk < k) {
                    float v = nearbyintf(load_f(w, w_bf16, col * stride_n + kk * stride_k) / scale);
                    q = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
                }
                dst[(kk / 4) * NR * 4 + j * 4 + (kk & 3)] = q;
                sum += q;
            }
            comp[p * NR + j] = 128 * sum;
        }
    }
}

/* 16 values of row x from k offset kk (the first ``cnt``; the rest 0) as float32. */
static inline __m512 load16(const void *x, int x_bf16, int64_t kk, int64_t cnt) {
    if (cnt <= 0) return _mm512_setzero_ps();
    const __mmask16 m = cnt >= 16 ? 0xFFFF : (__mmask16)((1u << cnt) - 1);
    if (!x_bf16) return _mm512_maskz_loadu_ps(m, (const float *)x + kk);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + kk);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* x rows [0, m) -> row blocks [ceil(m / MR)][ceil(k / 4)][MR] of uint8 quads (xq + 128) and the
 * per-row scales sx (rows past m and k past the end: xq 0). Quantized 16 values at a time: x / sx
 * rounded to nearest even and clamped to [-127, 127], as ``quantize_rows`` in linear_int8.py. */
static void pack_rows(const void *x, int x_bf16, int64_t m, int64_t k, uint32_t *xp, float *sx) {
    const int64_t blocks = (m + MR - 1) / MR, k4 = (k + 3) / 4;
    const size_t elem = x_bf16 ? 2 : 4;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < MR; r++) {
            const int64_t row = b * MR + r;
            uint32_t *dst = xp + b * k4 * MR + r;
            if (row >= m) {
                for (int64_t q = 0; q < k4; q++) dst[q * MR] = 0x80808080u;
                continue;
            }
            const void *xr = (const char *)x + row * k * elem;
            __m512 vmax = _mm512_setzero_ps();
            for (int64_t kk = 0; kk < k; kk += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(xr, x_bf16, kk, k - kk)));
            const float amax = _mm512_reduce_max_ps(vmax);
            const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
            sx[row] = scale;
            const __m512 vscale = _mm512_set1_ps(scale), lim = _mm512_set1_ps(127.0f);
            for (int64_t kk = 0; kk < 4 * k4; kk += 16) {
                __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(xr, x_bf16, kk, k - kk), vscale),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_max_ps(_mm512_min_ps(v, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
                const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
                uint32_t quads[4];
                _mm_storeu_si128((__m128i *)quads, _mm512_cvtepi32_epi8(q));
                const int64_t q0 = kk / 4, n = k4 - q0 < 4 ? k4 - q0 : 4;
                for (int64_t t = 0; t < n; t++) dst[(q0 + t) * MR] = quads[t];
            }
        }
}

static inline void store_row(void *out, int out_bf16, int64_t off, __mmask16 mask, __m512 v) {
    if (out_bf16) { /* round to nearest even (NaN cannot arise from finite int8 products) */
        __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
        _mm256_mask_storeu_epi16((uint16_t *)out + off, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_mask_storeu_ps((float *)out + off, mask, v);
    }
}

static inline __attribute__((always_inline)) void row_block(
    const int rows, const uint32_t *xp, const float *sx, int64_t k4, const int8_t *panel, const char *pf,
    int64_t pf_lines, void *out, int out_bf16, int64_t o0, int64_t ldo, __mmask16 m0, __mmask16 m1,
    const float *sw, const int32_t *comp, const float *bias) {
    __m512i acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            acc[r][0] = _mm512_setzero_si512();
            acc[r][1] = _mm512_setzero_si512();
        }
    }
    int64_t pf_acc = 0;
    for (int64_t kk = 0; kk < k4; kk++) {
        const __m512i w0 = _mm512_load_si512(panel + kk * NR * 4);
        const __m512i w1 = _mm512_load_si512(panel + kk * NR * 4 + 64);
        pf_acc += pf_lines;
        while (pf_acc >= k4) {
            _mm_prefetch(pf, _MM_HINT_T1);
            pf += 64;
            pf_acc -= k4;
        }
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                const __m512i xv = _mm512_set1_epi32((int)xp[kk * MR + r]);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xv, w1);
            }
        }
    }
    const __m512i c0 = _mm512_loadu_si512(comp), c1 = _mm512_loadu_si512(comp + 16);
    const __m512 s0 = _mm512_maskz_loadu_ps(m0, sw), s1 = _mm512_maskz_loadu_ps(m1, sw + 16);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_maskz_loadu_ps(m0, bias);
        b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            const __m512 xs = _mm512_set1_ps(sx[r]);
            __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], c0)), _mm512_mul_ps(s0, xs));
            __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], c1)), _mm512_mul_ps(s1, xs));
            if (bias) {
                v0 = _mm512_add_ps(v0, b0);
                v1 = _mm512_add_ps(v1, b1);
            }
            store_row(out, out_bf16, o0 + r * ldo, m0, v0);
            store_row(out, out_bf16, o0 + r * ldo + 16, m1, v1);
        }
    }
}

typedef struct {
    const int8_t *packed;
    const float *sw;
    const int32_t *comp;
    const float *bias;
    int64_t n, k4;
    void *out;
    int out_bf16;
} Weights;

static void panel_rows(const Weights *W, const uint32_t *xp, const float *sx, int64_t m, int64_t p,
                       const int8_t *next, int64_t o0, __mmask16 m0, __mmask16 m1) {
    const int64_t blocks = (m + MR - 1) / MR, k4 = W->k4;
    const int64_t lines = next ? k4 * NR * 4 / 64 : 0;
    const int8_t *panel = W->packed + p * k4 * NR * 4;
    const float *sw = W->sw + p * NR, *bias = W->bias ? W->bias + p * NR : 0;
    const int32_t *comp = W->comp + p * NR;
    for (int64_t r0 = 0, b = 0; r0 < m; r0 += MR, b++) {
        const int64_t rows = m - r0 < MR ? m - r0 : MR;
        const uint32_t *xb = xp + b * k4 * MR;
        const int64_t l0 = lines * b / blocks, l1 = lines * (b + 1) / blocks;
        const char *pf = next ? (const char *)next + l0 * 64 : 0;
        const int64_t ob = o0 + r0 * W->n;
        switch (rows) {
#define ARM(R) case R: row_block(R, xb, sx + r0, k4, panel, pf, l1 - l0, W->out, W->out_bf16, ob, W->n, m0, m1, sw, comp, bias); break;
            ARM(1) ARM(2) ARM(3) ARM(4) ARM(5) ARM(6) ARM(7) ARM(8) ARM(9) ARM(10) ARM(11) ARM(12)
#undef ARM
        }
    }
}

/* Panels [p0, p1) for packed rows [0, m) whose output starts at row o_row. */
static void panel_range(const Weights *W, const uint32_t *xp, const float *sx, int64_t m, int64_t o_row,
                        int64_t p0, int64_t p1) {
    int64_t group = L2_PANEL_BYTES / (W->k4 * NR * 4);
    if (group < 1) group = 1;
    const int64_t row_tile = m <= 2 * MR ? m : MR * 8;
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
        const int64_t g1 = g0 + group < p1 ? g0 + group : p1;
        for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
            const int64_t rows = m - r0 < row_tile ? m - r0 : row_tile;
            for (int64_t p = g0; p < g1; p++) {
                const int64_t cols = W->n - p * NR < NR ? W->n - p * NR : NR;
                const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
                const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
                const int8_t *next = (r0 == 0 && p + 1 < p1) ? W->packed + (p + 1) * W->k4 * NR * 4 : 0;
                panel_rows(W, xp + (r0 / MR) * W->k4 * MR, sx + r0, rows, p, next, (o_row + r0) * W->n + p * NR,
                           m0, m1);
            }
        }
    }
}

/* out [m, n] (float32, or bf16 if out_bf16) = W8A8(x [m, k] (float32, or bf16 if x_bf16), W) + bias,
 * W packed by xllm_panel_pack_int8 (packed, scales, comp). */
void xllm_panel_gemm_int8(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *packed,
                          const float *scales, const int32_t *comp, int64_t n, const float *bias, void *out,
                          int out_bf16, int threads) {
    const int64_t panels = (n + NR - 1) / NR, blocks = (m + MR - 1) / MR, k4 = (k + 3) / 4;
    const Weights W = {packed, scales, comp, bias, n, k4, out, out_bf16};
    uint32_t *xp = aligned_alloc(64, (size_t)(blocks * MR * k4 * 4 + 63) / 64 * 64);
    float *sx = malloc((size_t)(blocks * MR) * sizeof(float));
    const int wide = m > 2 * MR;
    if (panels <= 4 * threads && m * k * n < PARALLEL_MIN_MACS) threads = 1;
    if (threads > (wide ? blocks : panels)) threads = (int)(wide ? blocks : panels);
    if (threads <= 1) {
        pack_rows(x, x_bf16, m, k, xp, sx);
        panel_range(&W, xp, sx, m, 0, 0, panels);
    } else if (wide) {
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
            const int64_t r0 = b0 * MR, r1 = b1 * MR < m ? b1 * MR : m;
            if (r1 > r0) {
                const size_t elem = x_bf16 ? 2 : 4;
                pack_rows((const char *)x + r0 * k * elem, x_bf16, r1 - r0, k, xp + b0 * k4 * MR, sx + r0);
                panel_range(&W, xp + b0 * k4 * MR, sx + r0, r1 - r0, r0, 0, panels);
            }
        }
    } else {
        pack_rows(x, x_bf16, m, k, xp, sx);
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            panel_range(&W, xp, sx, m, 0, p0, p1);
        }
    }
    free(sx);
    free(xp);
}
