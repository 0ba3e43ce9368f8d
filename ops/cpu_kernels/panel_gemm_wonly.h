/* Weight-only int8 / int4 panel GEMM, shared by two builds: panel_gemm_wonly.c (float32 FMAs, AVX-512F)
 * and panel_gemm_wonly_bf16.c (the bf16 dot-product unit, ``vdpbf16ps``; WONLY_BF16 defined).
 *
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W = (q - zero) * scale, q int8 (zero 0, one scale per
 * output channel) or int4 in [0, 15] (a scale and a zero per output channel and group of k).
 *
 * Weights stay packed in 32-column panels of k pairs, 1 / 4 (int8) or 1 / 8 (int4) of float32's bytes:
 *   int8: [ceil(N / 32)][ceil(K / 2)][32][2] int8 (64 bytes per k pair);
 *   int4: [ceil(N / 32)][ceil(K / 2)][32] bytes, k even in the low nibble, k odd in the high one;
 *   scales float32 and zeros int32: [ceil(N / 32)][groups][32] (int8: one group of all K, zeros unused).
 * Each panel is dequantized a chunk (at most 128 k, never across a group) at a time into a small
 * buffer that stays in L1, as exact integers (q, or q - zero): float32, or bf16 pairs (|q - zero| <= 128
 * is exact in bf16). Every row block then multiplies the chunk with 24 zmm accumulators (12 rows x 32
 * columns), which are kept in memory between chunks; at the end of a group they are multiplied by the
 * group's scales and added to the output accumulators. The next panel's bytes are prefetched while a
 * chunk is dequantized. Rows go through in tiles of 96 (x packed once per tile, reused for every panel).
 *
 * A row's arithmetic depends only on its own x and the weights (chunk bounds follow K and the groups),
 * so its result is the same whatever batch, row block or thread it shares (bit for bit). x float32 or
 * bf16 (the bf16 build rounds float32 x to bf16 as it is packed; the float32 build widens bf16 x
 * exactly), out float32 or bf16 (rounded once), bias float32. Threads: panels for few rows, row blocks
 * for wide x (prefill).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 32
#define MR 12
#define KC_PAIRS 64 /* k pairs dequantized per chunk: 128 k */
#define ROW_TILE (8 * MR)
#define PARALLEL_MIN_MACS (16 << 20)

#ifdef WONLY_BF16
#define STEPS_PER_PAIR 1 /* one vdpbf16ps step multiplies a k pair */
typedef uint32_t xelem;  /* a bf16 pair of x */
#define FN(name) name##_bf16
#else
#define STEPS_PER_PAIR 2
typedef float xelem;
#define FN(name) name##_f32
#endif

typedef struct {
    const uint8_t *packed;
    int bits;
    const float *scales;
    const int32_t *zeros;
    int64_t k2, n, group_pairs, groups, panel_bytes;
    const float *bias;
    void *out;
    int out_bf16;
} WQ;

static inline float bf16_to_f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rows [0, m) of x (float32 or bf16, k per row) -> row blocks [ceil(m / MR)][steps][MR] of xelem
 * (rows past m and k past the end: 0). */
static void pack_rows(const void *x, int x_bf16, int64_t m, int64_t k, int64_t k2, xelem *xp) {
    const int64_t blocks = (m + MR - 1) / MR, steps = k2 * STEPS_PER_PAIR;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < MR; r++) {
            const int64_t row = b * MR + r;
            xelem *dst = xp + b * steps * MR + r;
            for (int64_t s = 0; s < steps; s++) {
#ifdef WONLY_BF16
                uint32_t lo = 0, hi = 0;
                if (row < m) {
                    const int64_t i = row * k + 2 * s;
                    lo = x_bf16 ? ((const uint16_t *)x)[i] : f_to_bf16(((const float *)x)[i]);
                    if (2 * s + 1 < k)
                        hi = x_bf16 ? ((const uint16_t *)x)[i + 1] : f_to_bf16(((const float *)x)[i + 1]);
                }
                dst[s * MR] = lo | (hi << 16);
#else
                float v = 0.0f;
                if (row < m && s < k) v = x_bf16 ? bf16_to_f(((const uint16_t *)x)[row * k + s]) : ((const float *)x)[row * k + s];
                dst[s * MR] = v;
#endif
            }
        }
}

/* What decoding one group's codes needs: int4's zeros (float32 build: the zeros; bf16 build: the
 * vpermw index offsets 16 - zero in both words, and the table bf16(i - 16)). */
typedef struct {
    __m512i z0, z1, table;
} Decoder;

static inline Decoder decoder(const int bits, const int32_t *z) {
    Decoder d = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    if (bits == 4) {
        d.z0 = _mm512_loadu_si512(z);
        d.z1 = _mm512_loadu_si512(z + 16);
#ifdef WONLY_BF16
        uint16_t t[32];
        for (int i = 0; i < 32; i++) t[i] = f_to_bf16((float)(i - 16));
        d.table = _mm512_loadu_si512(t);
        const __m512i sixteen = _mm512_set1_epi32(16), both = _mm512_set1_epi32(0x10001);
        d.z0 = _mm512_mullo_epi32(_mm512_sub_epi32(sixteen, d.z0), both);
        d.z1 = _mm512_mullo_epi32(_mm512_sub_epi32(sixteen, d.z1), both);
#endif
    }
    return d;
}

/* The weights of k pair j of a panel as exact integers: w[0], w[1] bf16 pairs of columns 0-15 and
 * 16-31 (bf16 build); w[0], w[1] the even k and w[2], w[3] the odd k (float32 build). */
static inline __attribute__((always_inline)) void decode_pair(const int bits, const uint8_t *panel, int64_t j,
                                                              const Decoder *d, __m512 *w) {
    for (int h = 0; h < 2; h++) {
        if (bits == 8) {
            const uint8_t *src = panel + j * 64 + 32 * h;
#ifdef WONLY_BF16
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
            w[h] = (__m512)_mm512_cvtne2ps_pbh(f1, f0);
#else
            const __m512i v = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)src));
            w[h] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
            w[2 + h] = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 8));
#endif
        } else {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(panel + j * 32 + 16 * h)));
#ifdef WONLY_BF16
            const __m512i idx = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000F000F));
            w[h] = (__m512)_mm512_permutexvar_epi16(_mm512_add_epi32(idx, h ? d->z1 : d->z0), d->table);
#else
            const __m512i z = h ? d->z1 : d->z0;
            w[h] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), z));
            w[2 + h] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), z));
#endif
        }
    }
}

/* Pairs [j0, j1) of a panel into the buffer w (128 bytes per step), prefetching the same bytes of the
 * next panel (NULL: none). */
static inline __attribute__((always_inline)) void dequantize(const int bits, const uint8_t *panel,
                                                             const uint8_t *next, int64_t j0, int64_t j1,
                                                             const Decoder *d, float *w) {
    const int64_t pair_bytes = bits == 8 ? 64 : 32;
    for (int64_t j = j0; j < j1; j++) {
        if (next && (bits == 8 || !(j & 1))) _mm_prefetch((const char *)next + j * pair_bytes, _MM_HINT_T1);
        __m512 v[4];
        decode_pair(bits, panel, j, d, v);
        for (int i = 0; i < 2 * STEPS_PER_PAIR; i++)
            _mm512_store_ps(w + (j - j0) * STEPS_PER_PAIR * NR + 16 * i, v[i]);
    }
}

/* One row block times pairs [j0, j1) of the panel: from the buffer w (dequantize wrote it), or
 * (direct: the tile's only row block) decoded here, prefetching the next panel's bytes. The
 * accumulators start at 0 (``start``: the group's first chunk) or from gacc; at the group's end
 * (``finish``) they are scaled into macc (set by the first group), else stored back to gacc. Both ways
 * run the same operations in the same order on the same values, so their results are identical. */
static inline __attribute__((always_inline)) void row_block(
    const int rows, const int bits, const int direct, const xelem *xb, int64_t j0, int64_t j1, const float *w,
    const uint8_t *panel, const uint8_t *next, const Decoder *d, float *gacc, float *macc, int start, int finish,
    int first_group, const float *scale) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            acc[r][0] = start ? _mm512_setzero_ps() : _mm512_load_ps(gacc + r * NR);
            acc[r][1] = start ? _mm512_setzero_ps() : _mm512_load_ps(gacc + r * NR + 16);
        }
    }
    const int64_t pair_bytes = bits == 8 ? 64 : 32;
    for (int64_t j = j0; j < j1; j++) {
        __m512 v[4];
        const xelem *xs = xb + (j - j0) * STEPS_PER_PAIR * MR;
        if (direct) {
            if (next && (bits == 8 || !(j & 1))) _mm_prefetch((const char *)next + j * pair_bytes, _MM_HINT_T1);
            decode_pair(bits, panel, j, d, v);
        } else {
            for (int i = 0; i < 2 * STEPS_PER_PAIR; i++) v[i] = _mm512_load_ps(w + (j - j0) * STEPS_PER_PAIR * NR + 16 * i);
        }
#ifdef WONLY_BF16
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xs[r]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)v[0], xv);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)v[1], xv);
            }
        }
#else
        for (int s = 0; s < 2; s++) {
#pragma GCC unroll 12
            for (int r = 0; r < MR; r++) {
                if (r < rows) {
                    const __m512 xv = _mm512_set1_ps(xs[s * MR + r]);
                    acc[r][0] = _mm512_fmadd_ps(xv, v[2 * s], acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xv, v[2 * s + 1], acc[r][1]);
                }
            }
        }
#endif
    }
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < rows) {
            float *g = finish ? macc + r * NR : gacc + r * NR;
            if (!finish) {
                _mm512_store_ps(g, acc[r][0]);
                _mm512_store_ps(g + 16, acc[r][1]);
            } else if (first_group) {
                _mm512_store_ps(g, _mm512_mul_ps(acc[r][0], s0));
                _mm512_store_ps(g + 16, _mm512_mul_ps(acc[r][1], s1));
            } else {
                _mm512_store_ps(g, _mm512_fmadd_ps(acc[r][0], s0, _mm512_load_ps(g)));
                _mm512_store_ps(g + 16, _mm512_fmadd_ps(acc[r][1], s1, _mm512_load_ps(g + 16)));
            }
        }
    }
}

static inline void store_row(void *out, int out_bf16, int64_t off, __mmask16 mask, __m512 v) {
    if (out_bf16) { /* round to nearest even; NaN stays a (quiet) NaN */
        __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)out + off, mask, u); /* vpmovdw: AVX-512F */
    } else {
        _mm512_mask_storeu_ps((float *)out + off, mask, v);
    }
}

/* The tile's rows [0, rows) (x packed in xp) times panel p, group by group and chunk by chunk, into
 * macc. One row block decodes the weights itself; several share a chunk dequantized once into w. */
static inline __attribute__((always_inline)) void panel_groups(const int bits, const WQ *W, const xelem *xp,
                                                               int64_t rows, int64_t p, int64_t p1, float *w,
                                                               float *gacc, float *macc) {
    const int64_t blocks = (rows + MR - 1) / MR, steps = W->k2 * STEPS_PER_PAIR;
    const uint8_t *panel = W->packed + p * W->panel_bytes;
    const uint8_t *next = p + 1 < p1 ? panel + W->panel_bytes : 0;
    for (int64_t g = 0; g < W->groups; g++) {
        const int64_t jg0 = g * W->group_pairs;
        const int64_t jg1 = jg0 + W->group_pairs < W->k2 ? jg0 + W->group_pairs : W->k2;
        const float *scale = W->scales + (p * W->groups + g) * NR;
        const Decoder d = decoder(bits, W->zeros ? W->zeros + (p * W->groups + g) * NR : 0);
        for (int64_t j0 = jg0; j0 < jg1; j0 += KC_PAIRS) {
            const int64_t j1 = j0 + KC_PAIRS < jg1 ? j0 + KC_PAIRS : jg1;
            const int start = j0 == jg0, finish = j1 == jg1, first = g == 0;
            if (blocks == 1) {
                const xelem *xb = xp + j0 * STEPS_PER_PAIR * MR;
                switch (rows) {
#define ARM(R) case R: row_block(R, bits, 1, xb, j0, j1, w, panel, next, &d, gacc, macc, start, finish, first, scale); break;
                    ARM(1) ARM(2) ARM(3) ARM(4) ARM(5) ARM(6) ARM(7) ARM(8) ARM(9) ARM(10) ARM(11) ARM(12)
#undef ARM
                }
                continue;
            }
            dequantize(bits, panel, next, j0, j1, &d, w);
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t rb = rows - b * MR < MR ? rows - b * MR : MR;
                const xelem *xb = xp + b * steps * MR + j0 * STEPS_PER_PAIR * MR;
                float *ga = gacc + b * MR * NR, *ma = macc + b * MR * NR;
                switch (rb) {
#define ARM(R) case R: row_block(R, bits, 0, xb, j0, j1, w, panel, next, &d, ga, ma, start, finish, first, scale); break;
                    ARM(1) ARM(2) ARM(3) ARM(4) ARM(5) ARM(6) ARM(7) ARM(8) ARM(9) ARM(10) ARM(11) ARM(12)
#undef ARM
                }
            }
        }
    }
}

/* The tile's rows [0, rows) (x packed in xp, output from row row0) times panels [p0, p1). */
static void tile_panels(const WQ *W, const xelem *xp, int64_t rows, int64_t row0, int64_t p0, int64_t p1,
                        float *w, float *gacc, float *macc) {
    for (int64_t p = p0; p < p1; p++) {
        if (W->bits == 8)
            panel_groups(8, W, xp, rows, p, p1, w, gacc, macc);
        else
            panel_groups(4, W, xp, rows, p, p1, w, gacc, macc);
        const int64_t cols = W->n - p * NR < NR ? W->n - p * NR : NR;
        const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
        const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        if (W->bias) {
            b0 = _mm512_maskz_loadu_ps(m0, W->bias + p * NR);
            b1 = _mm512_maskz_loadu_ps(m1, W->bias + p * NR + 16);
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t off = (row0 + r) * W->n + p * NR;
            store_row(W->out, W->out_bf16, off, m0, _mm512_add_ps(_mm512_load_ps(macc + r * NR), b0));
            store_row(W->out, W->out_bf16, off + 16, m1, _mm512_add_ps(_mm512_load_ps(macc + r * NR + 16), b1));
        }
    }
}

/* Rows [r0, r1) times panels [p0, p1), a tile of rows at a time, with this thread's own buffers. */
static void rows_panels(const WQ *W, const void *x, int x_bf16, int64_t k, int64_t r0, int64_t r1, int64_t p0,
                        int64_t p1) {
    const int64_t steps = W->k2 * STEPS_PER_PAIR;
    const size_t xbytes = (size_t)ROW_TILE * steps * sizeof(xelem);
    xelem *xp = aligned_alloc(64, (xbytes + 63) / 64 * 64);
    float *w = aligned_alloc(64, (size_t)KC_PAIRS * 2 * NR * sizeof(float));
    float *gacc = aligned_alloc(64, (size_t)ROW_TILE * NR * sizeof(float));
    float *macc = aligned_alloc(64, (size_t)ROW_TILE * NR * sizeof(float));
    const size_t elem = x_bf16 ? 2 : 4;
    for (int64_t t0 = r0; t0 < r1; t0 += ROW_TILE) {
        const int64_t rows = r1 - t0 < ROW_TILE ? r1 - t0 : ROW_TILE;
        pack_rows((const char *)x + t0 * k * elem, x_bf16, rows, k, W->k2, xp);
        tile_panels(W, xp, rows, t0, p0, p1, w, gacc, macc);
    }
    free(macc);
    free(gacc);
    free(w);
    free(xp);
}

/* out [m, n] (float32, or bf16 if out_bf16) = x [m, k] (float32, or bf16 if x_bf16) @ W^T + bias; W
 * packed as described above (bits 8 or 4; groups of group k, an even number, the last one shorter). */
void FN(xllm_wonly_gemm)(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed, int bits,
                         const float *scales, const int32_t *zeros, int64_t group, int64_t groups, int64_t n,
                         const float *bias, void *out, int out_bf16, int threads) {
    const int64_t panels = (n + NR - 1) / NR, k2 = (k + 1) / 2, blocks = (m + MR - 1) / MR;
    const WQ W = {packed, bits, scales, bits == 4 ? zeros : 0, k2, n, group / 2, groups,
                  k2 * (bits == 8 ? 64 : 32), bias, out, out_bf16};
    const int wide = m > 2 * MR;
    if (panels <= 4 * threads && m * k * n < PARALLEL_MIN_MACS) threads = 1;
    if (threads > (wide ? blocks : panels)) threads = (int)(wide ? blocks : panels);
    if (threads <= 1) {
        rows_panels(&W, x, x_bf16, k, 0, m, 0, panels);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (wide) {
            const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
            const int64_t r0 = b0 * MR, r1 = b1 * MR < m ? b1 * MR : m;
            if (r1 > r0) rows_panels(&W, x, x_bf16, k, r0, r1, 0, panels);
        } else {
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            if (p1 > p0) rows_panels(&W, x, x_bf16, k, 0, m, p0, p1);
        }
    }
}
