/* bf16 GEMM on the CPU's bf16 dot-product unit (AVX512_BF16 ``vdpbf16ps``), fp32 accumulation:
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W packed in 32-column panels of bf16 pairs.
 *
 * The same design as panel_gemm.c (panels streamed once per call with the next one prefetched into
 * L2, rows in blocks of up to 12 in 24 zmm accumulators, L2-sized panel groups for wide x), with two
 * differences: a panel is [ceil(K / 2)][32 columns][2] bf16 (one zmm holds 16 columns x a pair of k),
 * and x is packed per row block as bf16 pairs [ceil(K / 2)][12] (one 32-bit broadcast per row and
 * k pair). ``vdpbf16ps`` adds both products of a pair to an fp32 accumulator: half the bytes of fp32
 * weights and two k per instruction.
 *
 * x may be float32 (rounded to bf16 when packed, nearest even) or bf16; out float32 or bf16 (rounded
 * once from the fp32 accumulator); bias float32. Every output element is one chain over the k pairs
 * in order, whatever M, the row block or the thread: a row's result does not depend on its batch.
 *
 * Needs AVX-512F/BW/VL and AVX512_BF16 (build.py builds it with those flags only where the CPU has
 * them).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 32
#define MR 12
#define L2_PANEL_BYTES (1 << 20)
#define PARALLEL_MIN_MACS (16 << 20)

int xllm_panel_gemm_bf16_abi(void) { return 1; }

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint16_t load_bf16(const void *src, int is_bf16, int64_t i) {
    return is_bf16 ? ((const uint16_t *)src)[i] : to_bf16(((const float *)src)[i]);
}

/* W [n, k] (float32 or bf16; element (j, kk) at w[j * stride_n + kk * stride_k]) -> panels
 * [ceil(n / 32)][ceil(k / 2)][32][2] bf16; columns past n and the k past the end zero. */
void xllm_panel_pack_bf16(const void *w, int w_bf16, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k,
                          uint16_t *packed) {
    const int64_t panels = (n + NR - 1) / NR, k2 = (k + 1) / 2;
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * k2 * NR * 2;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t col = p * NR + j;
            for (int64_t kk = 0; kk < 2 * k2; kk++) {
                uint16_t v = 0;
                if (col < n && kk < k) v = load_bf16(w, w_bf16, col * stride_n + kk * stride_k);
                dst[(kk / 2) * NR * 2 + j * 2 + (kk & 1)] = v;
            }
        }
    }
}

/* x rows [0, m) (float32 or bf16, row-major, k per row) -> row blocks [ceil(m / MR)][ceil(k / 2)][MR]
 * of bf16 pairs (one uint32 each; rows past m and the k past the end zero). */
static void pack_rows(const void *x, int x_bf16, int64_t m, int64_t k, uint32_t *xp) {
    const int64_t blocks = (m + MR - 1) / MR, k2 = (k + 1) / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < MR; r++) {
            const int64_t row = b * MR + r;
            uint32_t *dst = xp + b * k2 * MR + r;
            for (int64_t kk2 = 0; kk2 < k2; kk2++) {
                uint32_t lo = 0, hi = 0;
                if (row < m) {
                    lo = load_bf16(x, x_bf16, row * k + 2 * kk2);
                    if (2 * kk2 + 1 < k) hi = load_bf16(x, x_bf16, row * k + 2 * kk2 + 1);
                }
                dst[kk2 * MR] = lo | (hi << 16);
            }
        }
}

static inline void store_row(void *out, int out_bf16, int64_t off, __mmask16 mask, __m512 v) {
    if (out_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)out + off, mask, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)out + off, mask, v);
}

static inline __attribute__((always_inline)) void row_block(
    const int rows, const uint32_t *xp, int64_t k2, const uint16_t *panel, const char *pf, int64_t pf_lines,
    void *out, int out_bf16, int64_t o0, int64_t ldo, __mmask16 m0, __mmask16 m1, const float *bias) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            acc[r][0] = _mm512_setzero_ps();
            acc[r][1] = _mm512_setzero_ps();
        }
    }
    int64_t pf_acc = 0;
    for (int64_t kk = 0; kk < k2; kk++) {
        const __m512bh w0 = (__m512bh)_mm512_load_si512(panel + kk * NR * 2);
        const __m512bh w1 = (__m512bh)_mm512_load_si512(panel + kk * NR * 2 + 32);
        pf_acc += pf_lines;
        while (pf_acc >= k2) {
            _mm_prefetch(pf, _MM_HINT_T1);
            pf += 64;
            pf_acc -= k2;
        }
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[kk * MR + r]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
            }
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_maskz_loadu_ps(m0, bias);
        b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            if (bias) {
                acc[r][0] = _mm512_add_ps(acc[r][0], b0);
                acc[r][1] = _mm512_add_ps(acc[r][1], b1);
            }
            store_row(out, out_bf16, o0 + r * ldo, m0, acc[r][0]);
            store_row(out, out_bf16, o0 + r * ldo + 16, m1, acc[r][1]);
        }
    }
}

/* Packed rows [0, m) times panel p in blocks of MR; the panel ``next`` (NULL: none) is prefetched. */
static void panel_rows(const uint32_t *xp, int64_t m, int64_t k2, const uint16_t *panel, const uint16_t *next,
                       void *out, int out_bf16, int64_t o0, int64_t ldo, __mmask16 m0, __mmask16 m1,
                       const float *bias) {
    const int64_t blocks = (m + MR - 1) / MR;
    const int64_t lines = next ? k2 * NR * 4 / 64 : 0;
    for (int64_t r0 = 0, b = 0; r0 < m; r0 += MR, b++) {
        const int64_t rows = m - r0 < MR ? m - r0 : MR;
        const uint32_t *xb = xp + b * k2 * MR;
        const int64_t l0 = lines * b / blocks, l1 = lines * (b + 1) / blocks;
        const char *pf = next ? (const char *)next + l0 * 64 : 0;
        const int64_t ob = o0 + r0 * ldo;
        switch (rows) {
#define ARM(R) case R: row_block(R, xb, k2, panel, pf, l1 - l0, out, out_bf16, ob, ldo, m0, m1, bias); break;
            ARM(1) ARM(2) ARM(3) ARM(4) ARM(5) ARM(6) ARM(7) ARM(8) ARM(9) ARM(10) ARM(11) ARM(12)
#undef ARM
        }
    }
}

/* Panels [p0, p1) for packed rows [0, m) (m a multiple of MR except at the end); out rows from o0. */
static void panel_range(const uint32_t *xp, int64_t m, int64_t k2, const uint16_t *packed, int64_t n,
                        const float *bias, void *out, int out_bf16, int64_t o0, int64_t p0, int64_t p1) {
    int64_t group = L2_PANEL_BYTES / (k2 * NR * 4);
    if (group < 1) group = 1;
    const int64_t row_tile = m <= 2 * MR ? m : MR * 8;
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
        const int64_t g1 = g0 + group < p1 ? g0 + group : p1;
        for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
            const int64_t rows = m - r0 < row_tile ? m - r0 : row_tile;
            for (int64_t p = g0; p < g1; p++) {
                const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
                const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
                const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
                const uint16_t *panel = packed + p * k2 * NR * 2;
                const uint16_t *next = (r0 == 0 && p + 1 < p1) ? panel + k2 * NR * 2 : 0;
                const float *bp = bias ? bias + p * NR : 0;
                panel_rows(xp + (r0 / MR) * k2 * MR, rows, k2, panel, next, out, out_bf16, o0 + r0 * n + p * NR, n,
                           m0, m1, bp);
            }
        }
    }
}

/* out [m, n] (row-major; float32, or bf16 if out_bf16) = x [m, k] (row-major; float32, or bf16 if
 * x_bf16) @ W^T + bias (float32 or NULL), W packed by xllm_panel_pack_bf16. */
void xllm_panel_gemm_bf16(const void *x, int x_bf16, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                          const float *bias, void *out, int out_bf16, int threads) {
    const int64_t panels = (n + NR - 1) / NR, blocks = (m + MR - 1) / MR, k2 = (k + 1) / 2;
    uint32_t *xp = aligned_alloc(64, (size_t)(blocks * MR * k2 * 4 + 63) / 64 * 64);
    const int wide = m > 2 * MR;
    if (panels <= 4 * threads && m * k * n < PARALLEL_MIN_MACS) threads = 1;
    if (threads > (wide ? blocks : panels)) threads = (int)(wide ? blocks : panels);
    if (threads <= 1) {
        pack_rows(x, x_bf16, m, k, xp);
        panel_range(xp, m, k2, packed, n, bias, out, out_bf16, 0, 0, panels);
    } else if (wide) {
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
            const int64_t r0 = b0 * MR, r1 = b1 * MR < m ? b1 * MR : m;
            if (r1 > r0) {
                const size_t elem = x_bf16 ? 2 : 4;
                pack_rows((const char *)x + r0 * k * elem, x_bf16, r1 - r0, k, xp + b0 * k2 * MR);
                panel_range(xp + b0 * k2 * MR, r1 - r0, k2, packed, n, bias, out, out_bf16, r0 * n, 0, panels);
            }
        }
    } else {
        pack_rows(x, x_bf16, m, k, xp);
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            panel_range(xp, m, k2, packed, n, bias, out, out_bf16, 0, p0, p1);
        }
    }
    free(xp);
}
