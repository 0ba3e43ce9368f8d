/* fp32 GEMM over weights packed in 32-column panels: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Built for the skinny inputs of decode steps (M = batch size): oneDNN and MKL run them about half
 * as fast as the weights stream from memory plus the FMAs take, because loading the next weight
 * block is not overlapped with multiplying the current one. Here each 32-column panel of W is
 * contiguous ([K][32] floats, read once from memory per call), the rows of x go through it in
 * blocks of up to 12 (24 zmm accumulators, each weight load feeding 12 x 2 FMAs), and while the
 * first row block multiplies panel p the next panel is prefetched into L2. Larger M is tiled: a
 * group of panels that fits L2 is swept by every row block before the next group.
 *
 * Every output element is one FMA chain over k = 0..K-1 in order (bias added after), whatever M,
 * the row block or the thread: results do not depend on the batch a row shares.
 *
 * Threads: OpenMP over panel ranges, or over row blocks for wide x (the process's libgomp, the one
 * torch loaded). Needs AVX-512F.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define NR 32
#define MR 12
#ifndef PF_AHEAD
#define PF_AHEAD 1 /* panels ahead that are prefetched */
#endif
#define L2_PANEL_BYTES (1 << 20) /* panels swept together by every row block */

int xllm_panel_gemm_abi(void) { return 1; }

/* W [n, k] (element (j, kk) at w[j * stride_n + kk * stride_k]) -> panels [ceil(n / 32)][k][32],
 * columns past n zero. Reads along whichever stride is 1. */
void xllm_panel_pack(const float *w, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k,
                     float *packed) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        if (stride_n == 1) { /* input-major: each k row of a panel is a contiguous run of W */
            for (int64_t kk = 0; kk < k; kk++) {
                const float *src = w + p * NR + kk * stride_k;
                for (int64_t j = 0; j < NR; j++) dst[kk * NR + j] = j < cols ? src[j] : 0.0f;
            }
        } else {
            for (int64_t j = 0; j < NR; j++) {
                const float *src = w + (p * NR + j) * stride_n;
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = j < cols ? src[kk * stride_k] : 0.0f;
            }
        }
    }
}

static inline __attribute__((always_inline)) void row_block(
    const int rows, const int packed_x, const float *x, int64_t k, const float *panel, const char *pf, int64_t pf_lines,
    float *out, int64_t ldo, __mmask16 m0, __mmask16 m1, const float *bias) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            acc[r][0] = _mm512_setzero_ps();
            acc[r][1] = _mm512_setzero_ps();
        }
    }
    int64_t pf_acc = 0; /* pf_lines cache lines of pf spread evenly over the k steps */
    for (int64_t kk = 0; kk < k; kk++) {
        const __m512 w0 = _mm512_load_ps(panel + kk * NR);
        const __m512 w1 = _mm512_load_ps(panel + kk * NR + 16);
        pf_acc += pf_lines;
        while (pf_acc >= k) {
            _mm_prefetch(pf, _MM_HINT_T1);
            pf += 64;
            pf_acc -= k;
        }
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                const __m512 xv = _mm512_set1_ps(packed_x ? x[kk * MR + r] : x[r * k + kk]);
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
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
            _mm512_mask_storeu_ps(out + r * ldo, m0, acc[r][0]);
            _mm512_mask_storeu_ps(out + r * ldo + 16, m1, acc[r][1]);
        }
    }
}

/* Rows [0, m) of x times panel p, rows in blocks of MR (the remainder block has a constant size
 * per switch arm so its accumulators stay in registers). The panel ``next`` (NULL: none) is
 * prefetched into L2 meanwhile, its lines spread evenly over every row block's k steps. x is
 * row-major, or (packed_x) packed by pack_rows. */
static inline __attribute__((always_inline)) void panel_rows(
    const int packed_x, const float *x, int64_t m, int64_t k, const float *panel, const float *next,
    float *out, int64_t ldo, __mmask16 m0, __mmask16 m1, const float *bias) {
    const int64_t blocks = (m + MR - 1) / MR;
    const int64_t lines = next ? k * NR * (int64_t)sizeof(float) / 64 : 0;
    for (int64_t r0 = 0, b = 0; r0 < m; r0 += MR, b++) {
        const int64_t rows = m - r0 < MR ? m - r0 : MR;
        const float *xb = x + r0 * k; /* row-major, or packed: block b starts at b * k * MR */
        float *ob = out + r0 * ldo;
        const int64_t l0 = lines * b / blocks, l1 = lines * (b + 1) / blocks;
        const char *pf = next ? (const char *)next + l0 * 64 : 0;
        switch (rows) {
#define ARM(R) case R: row_block(R, packed_x, xb, k, panel, pf, l1 - l0, ob, ldo, m0, m1, bias); break;
            ARM(1) ARM(2) ARM(3) ARM(4) ARM(5) ARM(6) ARM(7) ARM(8) ARM(9) ARM(10) ARM(11) ARM(12)
#undef ARM
        }
    }
}

/* x [m, k] row-major -> row blocks [ceil(m / MR)][k][MR] (rows past m zero): a row block's values
 * of one k are adjacent, so the broadcasts of a k step read one cache line. */
static void pack_rows(const float *x, int64_t m, int64_t k, float *xp) {
    const int64_t blocks = (m + MR - 1) / MR;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < MR; r++) {
            const int64_t row = b * MR + r;
            float *dst = xp + b * k * MR + r;
            if (row < m)
                for (int64_t kk = 0; kk < k; kk++) dst[kk * MR] = x[row * k + kk];
            else
                for (int64_t kk = 0; kk < k; kk++) dst[kk * MR] = 0.0f;
        }
}

/* Panels [p0, p1); xp: x packed by pack_rows (NULL: x row-major, for skinny x). */
static void panel_range(const float *x, const float *xp, int64_t m, int64_t k, const float *packed,
                        int64_t n, const float *bias, float *out, int64_t p0, int64_t p1) {
    int64_t group = L2_PANEL_BYTES / (k * NR * (int64_t)sizeof(float));
    if (group < 1) group = 1;
    /* Skinny x (decode): one row block per panel, so sweep panel by panel, prefetching the next. */
    const int64_t row_tile = m <= 2 * MR ? m : MR * 8;
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
        const int64_t g1 = g0 + group < p1 ? g0 + group : p1;
        for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
            const int64_t rows = m - r0 < row_tile ? m - r0 : row_tile;
            for (int64_t p = g0; p < g1; p++) {
                const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
                const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
                const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
                const float *panel = packed + p * k * NR;
                const float *next = (r0 == 0 && p + PF_AHEAD < p1) ? panel + PF_AHEAD * k * NR : 0;
                const float *bp = bias ? bias + p * NR : 0;
                float *op = out + r0 * n + p * NR;
                if (xp)
                    panel_rows(1, xp + r0 * k, rows, k, panel, next, op, n, m0, m1, bp);
                else
                    panel_rows(0, x + r0 * k, rows, k, panel, next, op, n, m0, m1, bp);
            }
        }
    }
}

#define PARALLEL_MIN_MACS (16 << 20)

/* out [m, n] (row-major) = x [m, k] (row-major) @ W^T + bias, W packed by xllm_panel_pack. */
void xllm_panel_gemm(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                     const float *bias, float *out, int threads) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t blocks = (m + MR - 1) / MR;
    float *xp = 0; /* wide x (prefill chunks) is packed, so its broadcasts stream */
    if (m > 2 * MR) xp = aligned_alloc(64, (size_t)(blocks * MR * k * sizeof(float) + 63) / 64 * 64);
    /* a small product on few panels: waking the other threads costs more than they save
     * (benchmarks/linear_gemm.py: 32 x 128 x 256 and 32 x 384 x 128 run faster on one thread) */
    if (panels <= 4 * threads && m * k * n < PARALLEL_MIN_MACS) threads = 1;
    if (threads > (xp ? blocks : panels)) threads = (int)(xp ? blocks : panels);
    if (threads <= 1) {
        if (xp) pack_rows(x, m, k, xp);
        panel_range(x, xp, m, k, packed, n, bias, out, 0, panels);
    } else if (xp) {
        /* wide x: each thread packs and multiplies its own row blocks by every panel (a layer of
         * few panels, 4 for a 128-wide output, would leave threads idle if split by panel) */
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
            const int64_t r0 = b0 * MR, r1 = b1 * MR < m ? b1 * MR : m;
            if (r1 > r0) {
                pack_rows(x + r0 * k, r1 - r0, k, xp + b0 * k * MR);
                panel_range(x + r0 * k, xp + b0 * k * MR, r1 - r0, k, packed, n, bias, out + r0 * n, 0,
                            panels);
            }
        }
    } else {
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            panel_range(x, xp, m, k, packed, n, bias, out, p0, p1);
        }
    }
    free(xp);
}
