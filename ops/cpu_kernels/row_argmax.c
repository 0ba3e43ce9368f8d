/* Greedy sampling's reduction: the index of each row's largest value, the first one on ties, the
 * first NaN if a row has one (torch's max(dim) rules). One pass, 16 lanes at a time, each lane
 * keeping its best value and the index where it first saw it; lanes then merge by (value, index).
 * float32 rows; AVX-512F; OpenMP over rows (the process's libgomp, torch's). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "avx512_on_avx2.h"

static int64_t row_argmax(const float *x, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_i = _mm512_set1_epi32(0x7fffffff);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + j);
        nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        const __mmask16 better = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, better, v);
        best_i = _mm512_mask_mov_epi32(best_i, better, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    if (nan) {
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) return j;
    }
    float vals[16];
    int32_t ids[16];
    _mm512_storeu_ps(vals, best);
    _mm512_storeu_si512(ids, best_i);
    int64_t arg = 0; /* an all -inf row: index 0, as torch */
    float top = -INFINITY;
    int32_t top_i = 0x7fffffff;
    for (int l = 0; l < 16; l++) {
        if (ids[l] != 0x7fffffff && (vals[l] > top || (vals[l] == top && ids[l] < top_i))) {
            top = vals[l];
            top_i = ids[l];
        }
    }
    if (top_i != 0x7fffffff) arg = top_i;
    return arg;
}

/* out[r] = argmax of row r of x [rows, n] (row stride ld floats); n < 2^31. */
void xllm_row_argmax(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads > 1 && rows > 1 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * ld, n);
}
