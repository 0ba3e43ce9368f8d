/* Decode attention on CPU: one query token per sequence over its cached context, read in place.
 *
 * For each sequence the query heads that share a KV head are that head's G query rows, so every K
 * and V row is read once from memory, whole tokens (all KV heads) at a time so the context streams:
 * pass 1 computes the Hq x L scores (q . k * scale), then a float32 softmax, pass 2 accumulates the
 * probabilities times V. The context is a list of runs of
 * consecutive tokens: the blocks of a paged cache (``xllm_decode_attention_paged``: a block table),
 * or one run per sequence in a virtually contiguous slot (``xllm_decode_attention_slots``: its
 * chunk's base address and its offset there, the xTensor layout). No gather, no padding, no mask: a sequence reads
 * positions [max(0, L - window), L) of its own length L.
 *
 * float32 q, cache and output, or (the *_bf16 functions) bfloat16 ones: K/V rows widened to float32
 * as they are read, q widened and the output rounded once per task, scores, softmax and sums float32.
 * The *_q8 functions read an 8-bit cache (int8 or fp8 e4m3 rows of head_dim values and a float32
 * scale, kv_quant.h) with float32 or bfloat16 q and output: values widened in registers, a K row's
 * scale applied to its score, a V row's to its probability, so a step reads about half the bytes of
 * a bfloat16 cache. head_dim a multiple of 16; AVX-512F. Threads: OpenMP over sequences (and KV-head
 * ranges when sequences are fewer than threads; the process's libgomp, torch's).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_quant.h"
#include "vec_math.h"

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_DIM 256
#define MAX_HEAD_FLOATS 8192 /* query heads x head_dim of one task's output accumulators */
#define TILE 64              /* tokens per run piece: all KV heads of a piece stay in L1/L2 */

/* The cache's element kinds; 8-bit rows carry their scale after the values. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };

typedef struct {
    const void *k, *v; /* first token of the run, KV head 0 (elements of the cache's kind) */
    int64_t n;         /* tokens, at most TILE */
} run_t;

/* 16 K/V elements at element i of row p, as float32 (KIND: a constant in each copy; fp8 / 256). */
static inline __attribute__((always_inline)) __m512 load_kv(const int KIND, const void *p, int64_t i) {
    if (KIND == KV_F32) return _mm512_loadu_ps((const float *)p + i);
    if (KIND == KV_BF16) return bf16_loadu((const uint16_t *)p + i);
    if (KIND == KV_INT8) return int8_loadu((const int8_t *)p + i);
    return fp8_loadu_div256((const uint8_t *)p + i);
}

/* The scale of the 8-bit row at element i of p, with fp8's 256 that load_kv leaves out. */
static inline __attribute__((always_inline)) float row_scale(const int KIND, const void *p, int64_t i,
                                                             int64_t dim) {
    const float s = q8_row_scale((const uint8_t *)p + i, dim);
    return KIND == KV_FP8 ? s * 256.0f : s;
}

/* Query heads [h0 * G, h1 * G) of one sequence over its runs (q, out: float32, at query head h0 * G).
 * G (query heads per KV head), CH (head_dim / 16) and KIND (the cache's elements) are constants in the
 * specialised copies, so the query rows and the accumulators of one KV head live in registers. */
static inline __attribute__((always_inline)) void attend_body(
    const int KIND, const int G, const int CH, const float *q, float *out, int64_t h0, int64_t h1, const run_t *runs,
    int64_t num_runs, int64_t stride, float scale, float *scores, int64_t total, float *acc_buf) {
    const int Q8 = KIND >= KV_INT8;
    const int64_t dim = CH * 16, heads = (h1 - h0) * G, hs = Q8 ? dim + 4 : dim; /* hs: KV head stride */
    float mx[MAX_HEAD_FLOATS / 16];
    for (int64_t row = 0; row < heads; row++) mx[row] = -FLT_MAX;
    /* pass 1: scores, run piece by piece, each piece's tokens once per KV head */
    for (int64_t r = 0, t0 = 0; r < num_runs; t0 += runs[r].n, r++) {
        for (int64_t h = h0; h < h1; h++) {
            const float *qh = q + (h - h0) * G * dim;
            const int64_t row0 = (h - h0) * G;
            __m512 qv[MAX_GROUP][MAX_DIM / 16];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < CH; c++) qv[g][c] = _mm512_loadu_ps(qh + g * dim + c * 16);
            for (int64_t i = 0; i < runs[r].n; i++) {
                const int64_t kr = i * stride + h * hs; /* elements from runs[r].k */
                __m512 acc[MAX_GROUP];
                for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
                for (int c = 0; c < CH; c++) {
                    const __m512 kv = load_kv(KIND, runs[r].k, kr + c * 16);
                    for (int g = 0; g < G; g++) acc[g] = _mm512_fmadd_ps(qv[g][c], kv, acc[g]);
                }
                const float rs = Q8 ? scale * row_scale(KIND, runs[r].k, kr, dim) : scale;
                for (int g = 0; g < G; g++) {
                    const float sc = _mm512_reduce_add_ps(acc[g]) * rs;
                    scores[(row0 + g) * total + t0 + i] = sc;
                    if (sc > mx[row0 + g]) mx[row0 + g] = sc;
                }
            }
        }
    }
    /* softmax numerators and their sums, 16 scores at a time */
    float inv[MAX_HEAD_FLOATS / 16];
    for (int64_t row = 0; row < heads; row++) {
        float *p = scores + row * total;
        const __m512 m = _mm512_set1_ps(mx[row]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < total; j += 16) {
            const __mmask16 k = total - j >= 16 ? 0xFFFF : (__mmask16)((1u << (total - j)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(k, vec_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), m)));
            _mm512_mask_storeu_ps(p + j, k, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[row] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* pass 2: probabilities times V, one KV head's accumulators in registers per piece */
    for (int64_t j = 0; j < heads * CH * 16; j++) acc_buf[j] = 0.0f;
    for (int64_t r = 0, t0 = 0; r < num_runs; t0 += runs[r].n, r++) {
        for (int64_t h = h0; h < h1; h++) {
            const int64_t row0 = (h - h0) * G;
            float *ab = acc_buf + row0 * dim;
            __m512 acc[MAX_GROUP][MAX_DIM / 16];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < CH; c++) acc[g][c] = _mm512_loadu_ps(ab + g * dim + c * 16);
            for (int64_t i = 0; i < runs[r].n; i++) {
                const int64_t vr = i * stride + h * hs; /* elements from runs[r].v */
                const float vs = Q8 ? row_scale(KIND, runs[r].v, vr, dim) : 1.0f;
                __m512 pv[MAX_GROUP];
                for (int g = 0; g < G; g++) {
                    const float p = scores[(row0 + g) * total + t0 + i];
                    pv[g] = _mm512_set1_ps(Q8 ? p * vs : p);
                }
                for (int c = 0; c < CH; c++) {
                    const __m512 vv = load_kv(KIND, runs[r].v, vr + c * 16);
                    for (int g = 0; g < G; g++) acc[g][c] = _mm512_fmadd_ps(pv[g], vv, acc[g][c]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < CH; c++) _mm512_storeu_ps(ab + g * dim + c * 16, acc[g][c]);
        }
    }
    for (int64_t row = 0; row < heads; row++) {
        const __m512 sc = _mm512_set1_ps(inv[row]);
        for (int64_t c = 0; c < CH; c++)
            _mm512_storeu_ps(out + row * dim + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc_buf + row * dim + c * 16), sc));
    }
}

static void attend(int kind, int g_rows, int64_t dim, const float *q, float *out, int64_t h0, int64_t h1,
                   const run_t *runs, int64_t num_runs, int64_t stride, float scale, float *scores,
                   int64_t total, float *acc_buf) {
#define ARGS q, out, h0, h1, runs, num_runs, stride, scale, scores, total, acc_buf
    switch (kind * 1000000 + g_rows * 1000 + dim) {
#define SPECIAL(B, G, D) case B * 1000000 + G * 1000 + D: attend_body(B, G, D / 16, ARGS); return;
#define SHAPES(B)                                                               \
        SPECIAL(B, 1, 32) SPECIAL(B, 2, 32) SPECIAL(B, 4, 32) SPECIAL(B, 8, 32)     \
        SPECIAL(B, 1, 64) SPECIAL(B, 2, 64) SPECIAL(B, 4, 64) SPECIAL(B, 8, 64)     \
        SPECIAL(B, 1, 128) SPECIAL(B, 2, 128) SPECIAL(B, 4, 128) SPECIAL(B, 8, 128)
        SHAPES(0) SHAPES(1) SHAPES(2) SHAPES(3)
#undef SHAPES
#undef SPECIAL
    }
    /* other shapes: the same code, sizes at run time */
    switch (kind) {
    case KV_F32: attend_body(KV_F32, g_rows, (int)(dim / 16), ARGS); break;
    case KV_BF16: attend_body(KV_BF16, g_rows, (int)(dim / 16), ARGS); break;
    case KV_INT8: attend_body(KV_INT8, g_rows, (int)(dim / 16), ARGS); break;
    default: attend_body(KV_FP8, g_rows, (int)(dim / 16), ARGS);
    }
#undef ARGS
}

/* The context [first, len) of a virtually contiguous run of tokens as pieces of at most TILE
 * (stride in bytes). */
static int64_t split_run(const char *k, const char *v, int64_t n, int64_t stride, run_t *runs) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i += TILE)
        runs[count++] = (run_t){k + i * stride, v + i * stride, n - i < TILE ? n - i : TILE};
    return count;
}

/* Tasks: (sequence, KV-head range). One range per sequence, unless there are fewer sequences than
 * threads: then the KV heads are split so every thread has work. */
static int64_t head_splits(int64_t batch, int64_t num_kv_heads, int threads) {
    if (threads <= 1 || batch >= threads) return 1;
    return num_kv_heads < threads ? num_kv_heads : threads;
}

int xllm_decode_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t dim) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP &&
           dim % 16 == 0 && dim <= MAX_DIM && num_heads * dim <= MAX_HEAD_FLOATS;
}

/* Where a sequence's context is: the blocks of a paged cache (tables set) or one virtually
 * contiguous run per sequence: token 0 of sequence b at k_chunks[chunk[b]] + offset[b] bytes
 * (addresses as int64; likewise V). Elements of elem_bytes bytes (4: float32, 2: bfloat16, 1: 8-bit). */
typedef struct {
    const char *k_cache, *v_cache;
    int64_t elem_bytes, block_stride, block_size, width;
    const int32_t *tables;
    const int64_t *k_chunks, *v_chunks, *chunk, *offset;
} source_t;

/* Positions [first, len) of sequence b as pieces of at most TILE tokens; returns how many. */
static int64_t context_runs(const source_t *src, int64_t b, int64_t first, int64_t len,
                            int64_t token_stride, run_t *runs) {
    const int64_t es = src->elem_bytes;
    if (!src->tables)
        return split_run(
            (const char *)(intptr_t)(src->k_chunks[src->chunk[b]] + src->offset[b]) + first * token_stride * es,
            (const char *)(intptr_t)(src->v_chunks[src->chunk[b]] + src->offset[b]) + first * token_stride * es,
            len - first, token_stride * es, runs);
    int64_t num_runs = 0;
    for (int64_t pos = first; pos < len;) {
        const int64_t blk = src->tables[b * src->width + pos / src->block_size], off = pos % src->block_size;
        const int64_t n = src->block_size - off < len - pos ? src->block_size - off : len - pos;
        const int64_t base = (blk * src->block_stride + off * token_stride) * es;
        num_runs += split_run(src->k_cache + base, src->v_cache + base, n, token_stride * es, runs + num_runs);
        pos += n;
    }
    return num_runs;
}

/* n (a multiple of 16) bfloat16 values to float32 and back (rounded to nearest even). */
static void widen(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(dst + j, bf16_loadu(src + j));
}

static void narrow(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) bf16_storeu(dst + j, _mm512_loadu_ps(src + j));
}

/* q, out: float32, or bfloat16 when q_bf16 (then a task widens its query rows into q_buf and rounds
 * its float32 results from o_buf into out once); the cache's elements of kind (KV_*). */
static void decode_attention(const void *q, void *out, int q_bf16, int kind, int64_t batch, int64_t num_heads,
                             int64_t num_kv_heads, int64_t dim, const source_t *src, int64_t token_stride,
                             const int32_t *seq_lens, int64_t window, float scale, int threads) {
    const int g_rows = (int)(num_heads / num_kv_heads), bf16 = q_bf16;
    int64_t max_len = 1;
    for (int64_t b = 0; b < batch; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* pieces: at most len / TILE + 1 from splitting, plus one per block (a partial first and last) */
    const int64_t max_runs = max_len / TILE + (src->tables ? max_len / src->block_size : 0) + 4;
    const int64_t splits = head_splits(batch, num_kv_heads, threads), tasks = batch * splits;
#pragma omp parallel num_threads(threads > 1 && tasks > 1 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * num_heads * max_len);
        float *acc_buf = malloc(sizeof(float) * num_heads * dim);
        float *q_buf = bf16 ? malloc(sizeof(float) * num_heads * dim * 2) : 0;
        float *o_buf = bf16 ? q_buf + num_heads * dim : 0;
        run_t *runs = malloc(sizeof(run_t) * max_runs);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / splits, part = task % splits;
            const int64_t h0 = num_kv_heads * part / splits, h1 = num_kv_heads * (part + 1) / splits;
            const int64_t len = seq_lens[b];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            const int64_t num_runs = context_runs(src, b, first, len, token_stride, runs);
            const int64_t qo = (b * num_heads + h0 * g_rows) * dim, n = (h1 - h0) * g_rows * dim;
            if (!bf16) {
                attend(kind, g_rows, dim, (const float *)q + qo, (float *)out + qo, h0, h1, runs, num_runs,
                       token_stride, scale, scores, len - first, acc_buf);
                continue;
            }
            widen((const uint16_t *)q + qo, q_buf, n);
            attend(kind, g_rows, dim, q_buf, o_buf, h0, h1, runs, num_runs, token_stride, scale, scores,
                   len - first, acc_buf);
            narrow(o_buf, (uint16_t *)out + qo, n);
        }
        free(runs);
        free(q_buf);
        free(acc_buf);
        free(scores);
    }
}

/* q, out [B, Hq, D]; k_cache / v_cache: token t of block blk, KV head h at
 * cache + blk * block_stride + (t % block_size) * token_stride + h * D; tables int32 [B, width]. */
void xllm_decode_attention_paged(const float *q, float *out, int64_t batch, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t dim, const float *k_cache,
                                 const float *v_cache, int64_t block_stride, int64_t token_stride,
                                 int64_t block_size, const int32_t *tables, int64_t width,
                                 const int32_t *seq_lens, int64_t window, float scale, int threads) {
    const source_t src = {.k_cache = (const char *)k_cache, .v_cache = (const char *)v_cache, .elem_bytes = 4,
                          .block_stride = block_stride, .block_size = block_size, .width = width, .tables = tables};
    decode_attention(q, out, 0, KV_F32, batch, num_heads, num_kv_heads, dim, &src, token_stride, seq_lens, window,
                     scale, threads);
}

/* xllm_decode_attention_paged with bfloat16 q, cache and out (strides in elements). */
void xllm_decode_attention_paged_bf16(const uint16_t *q, uint16_t *out, int64_t batch, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t dim, const uint16_t *k_cache,
                                      const uint16_t *v_cache, int64_t block_stride, int64_t token_stride,
                                      int64_t block_size, const int32_t *tables, int64_t width,
                                      const int32_t *seq_lens, int64_t window, float scale, int threads) {
    const source_t src = {.k_cache = (const char *)k_cache, .v_cache = (const char *)v_cache, .elem_bytes = 2,
                          .block_stride = block_stride, .block_size = block_size, .width = width, .tables = tables};
    decode_attention(q, out, 1, KV_BF16, batch, num_heads, num_kv_heads, dim, &src, token_stride, seq_lens, window,
                     scale, threads);
}

/* As above with each sequence's context one virtually contiguous run (a slot of the xTensor
 * layout): token t, KV head h of sequence b at k_chunks[chunk[b]] + offset[b] bytes
 * + (t * token_stride + h * D) elements; k_chunks / v_chunks: the layer's chunk base addresses, the
 * same for every layer's call of a step except these two. */
void xllm_decode_attention_slots(const float *q, float *out, int64_t batch, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t dim, const int64_t *k_chunks,
                                 const int64_t *v_chunks, const int64_t *chunk, const int64_t *offset,
                                 int64_t token_stride, const int32_t *seq_lens, int64_t window,
                                 float scale, int threads) {
    const source_t src = {.elem_bytes = 4, .block_size = 1, .k_chunks = k_chunks, .v_chunks = v_chunks,
                          .chunk = chunk, .offset = offset};
    decode_attention(q, out, 0, KV_F32, batch, num_heads, num_kv_heads, dim, &src, token_stride, seq_lens, window,
                     scale, threads);
}

/* xllm_decode_attention_slots with bfloat16 q, cache and out. */
void xllm_decode_attention_slots_bf16(const uint16_t *q, uint16_t *out, int64_t batch, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t dim, const int64_t *k_chunks,
                                      const int64_t *v_chunks, const int64_t *chunk, const int64_t *offset,
                                      int64_t token_stride, const int32_t *seq_lens, int64_t window,
                                      float scale, int threads) {
    const source_t src = {.elem_bytes = 2, .block_size = 1, .k_chunks = k_chunks, .v_chunks = v_chunks,
                          .chunk = chunk, .offset = offset};
    decode_attention(q, out, 1, KV_BF16, batch, num_heads, num_kv_heads, dim, &src, token_stride, seq_lens, window,
                     scale, threads);
}

/* xllm_decode_attention_paged over an 8-bit cache (fp8: e4m3 rows, else int8; strides in bytes, dim
 * the head_dim without the scale), q and out float32 or (q_bf16) bfloat16. */
void xllm_decode_attention_paged_q8(const void *q, void *out, int q_bf16, int fp8, int64_t batch, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, const void *k_cache, const void *v_cache,
                                    int64_t block_stride, int64_t token_stride, int64_t block_size,
                                    const int32_t *tables, int64_t width, const int32_t *seq_lens, int64_t window,
                                    float scale, int threads) {
    const source_t src = {.k_cache = (const char *)k_cache, .v_cache = (const char *)v_cache, .elem_bytes = 1,
                          .block_stride = block_stride, .block_size = block_size, .width = width, .tables = tables};
    decode_attention(q, out, q_bf16, fp8 ? KV_FP8 : KV_INT8, batch, num_heads, num_kv_heads, dim, &src,
                     token_stride, seq_lens, window, scale, threads);
}

/* xllm_decode_attention_slots over an 8-bit cache (as xllm_decode_attention_paged_q8). */
void xllm_decode_attention_slots_q8(const void *q, void *out, int q_bf16, int fp8, int64_t batch, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, const int64_t *k_chunks,
                                    const int64_t *v_chunks, const int64_t *chunk, const int64_t *offset,
                                    int64_t token_stride, const int32_t *seq_lens, int64_t window, float scale,
                                    int threads) {
    const source_t src = {.elem_bytes = 1, .block_size = 1, .k_chunks = k_chunks, .v_chunks = v_chunks,
                          .chunk = chunk, .offset = offset};
    decode_attention(q, out, q_bf16, fp8 ? KV_FP8 : KV_INT8, batch, num_heads, num_kv_heads, dim, &src,
                     token_stride, seq_lens, window, scale, threads);
}

/* The step's new K/V rows into an 8-bit cache, each (token, KV head) row quantized with its own
 * scale (kv_quant.h): token i's rows (float32, or bfloat16 when src_bf16; k_new + i * k_stride
 * elements, heads contiguous) to the rows of slot slots[i]. dim a multiple of 16. */
void xllm_store_kv_q8(const void *k_new, const void *v_new, int64_t k_stride, int64_t v_stride, void *k_cache,
                      void *v_cache, const int64_t *slots, int64_t n, int64_t num_kv_heads, int64_t dim,
                      int src_bf16, int fp8, int threads) {
    const int64_t es = src_bf16 ? 2 : 4, row = dim + 4;
#pragma omp parallel for schedule(static) num_threads(n >= 64 && threads > 1 ? threads : 1)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (slots[i] * num_kv_heads + h) * row;
            quantize_row((const char *)k_new + (i * k_stride + h * dim) * es, src_bf16, fp8, dim,
                         (uint8_t *)k_cache + dst);
            quantize_row((const char *)v_new + (i * v_stride + h * dim) * es, src_bf16, fp8, dim,
                         (uint8_t *)v_cache + dst);
        }
    }
}

/* The step's new K/V rows into the cache: token i's row (row elements of elem_bytes bytes;
 * k_new + i * k_stride elements) to k_cache + slots[i] * row elements, likewise V. One memcpy per
 * row: a decode step writes a few rows per layer, where a torch index_copy_ pays more in dispatch
 * than in copying. */
void xllm_store_kv(const void *k_new, const void *v_new, int64_t k_stride, int64_t v_stride, void *k_cache,
                   void *v_cache, const int64_t *slots, int64_t n, int64_t row, int64_t elem_bytes) {
    const size_t bytes = (size_t)(elem_bytes * row);
    for (int64_t i = 0; i < n; i++) {
        memcpy((char *)k_cache + slots[i] * bytes, (const char *)k_new + i * k_stride * elem_bytes, bytes);
        memcpy((char *)v_cache + slots[i] * bytes, (const char *)v_new + i * v_stride * elem_bytes, bytes);
    }
}
