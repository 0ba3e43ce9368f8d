/* Recurrent scans of hybrid models, token by token with the state held in cache: the gated delta
 * rule (Qwen3-Next's gated DeltaNet) and the SSD scan (Mamba2, Nemotron-H).
 *
 * One task per (sequence, value head) runs every token of its segment through that head's state
 * ([Dk, Dv] or [P, N] float32, a few KiB to 64 KiB: it stays in L1/L2 across the tokens), so each
 * token costs one or two passes over the state instead of torch's chain of ops each reading and
 * writing it from memory. Tasks run in parallel (OpenMP, the process's libgomp).
 *
 * The state is read from ``state_in`` at the first token and lives in ``state_out`` after it (the two
 * may be the same buffer), so the caller's starting state is left untouched unless it asks otherwise.
 * All tensors are contiguous float32; see ops/cpu_kernels/recurrent.py for the layouts.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Gated delta rule. Per value head with state S [Dk, Dv] and token t:
 *   S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  out_t = S^T q_t
 * with q, k L2-normalised (when l2norm) and q scaled. Key head hv / (Hv / Hk) serves value head hv.
 * q, k: [B, T, Hk, Dk]; v, out: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv]. */
void xllm_gated_delta_f32(const float *q, const float *k, const float *v, const float *g,
                          const float *beta, const float *state_in, float *state_out, float *out,
                          int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                          float scale, int l2norm, int threads) {
    const int64_t group = Hv / Hk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < B * Hv; task++) {
        const int64_t b = task / Hv, hv = task % Hv, hk = hv / group;
        float qn[Dk], kn[Dk], acc[Dv];
        float *S = state_out + task * Dk * Dv;
        const float *src = state_in + task * Dk * Dv;
        for (int64_t t = 0; t < T; t++) {
            const float *qt = q + ((b * T + t) * Hk + hk) * Dk;
            const float *kt = k + ((b * T + t) * Hk + hk) * Dk;
            const float *vt = v + ((b * T + t) * Hv + hv) * Dv;
            float *ot = out + ((b * T + t) * Hv + hv) * Dv;
            const int64_t gi = (b * T + t) * Hv + hv;
            float qs = scale, ks = 1.0f;
            if (l2norm) {
                float sq = 0.0f, sk = 0.0f;
                for (int64_t i = 0; i < Dk; i++) {
                    sq += qt[i] * qt[i];
                    sk += kt[i] * kt[i];
                }
                qs = scale / sqrtf(sq + 1e-6f);
                ks = 1.0f / sqrtf(sk + 1e-6f);
            }
            for (int64_t i = 0; i < Dk; i++) {
                qn[i] = qt[i] * qs;
                kn[i] = kt[i] * ks;
            }
            /* pass 1: decay the state, recall what it holds for k */
            const float decay = expf(g[gi]);
            for (int64_t j = 0; j < Dv; j++) acc[j] = 0.0f;
            for (int64_t i = 0; i < Dk; i++) {
                const float *si = src + i * Dv; /* may be di */
                float *di = S + i * Dv;
                const float ki = kn[i];
#pragma omp simd
                for (int64_t j = 0; j < Dv; j++) {
                    const float s = si[j] * decay;
                    di[j] = s;
                    acc[j] += ki * s;
                }
            }
            src = S;
            /* the written values, then pass 2: write them and read with q */
            const float bt = beta[gi];
            for (int64_t j = 0; j < Dv; j++) acc[j] = bt * (vt[j] - acc[j]);
            for (int64_t j = 0; j < Dv; j++) ot[j] = 0.0f;
            for (int64_t i = 0; i < Dk; i++) {
                float *restrict si = S + i * Dv;
                const float ki = kn[i], qi = qn[i];
#pragma omp simd
                for (int64_t j = 0; j < Dv; j++) {
                    const float s = si[j] + ki * acc[j];
                    si[j] = s;
                    ot[j] += qi * s;
                }
            }
        }
        if (T == 0 && S != src) memcpy(S, src, (size_t)(Dk * Dv) * sizeof(float));
    }
}

/* SSD scan (Mamba2). Per head h (group h / (H / G)) with state S [P, N] and token t:
 *   S = exp(dt_t A_h) S + (dt_t x_t) B_t^T;  y_t = S C_t + D_h x_t
 * x, y: [Bt, T, H, P]; dt: [Bt, T, H]; A, D: [H] (D may be NULL); B, C: [Bt, T, G, N];
 * state: [Bt, H, P, N]. */
void xllm_ssd_scan_f32(const float *x, const float *dt, const float *A, const float *Bm,
                       const float *C, const float *D, const float *state_in, float *state_out,
                       float *y, int64_t Bt, int64_t T, int64_t H, int64_t P, int64_t G, int64_t N,
                       int threads) {
    const int64_t per_group = H / G;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < Bt * H; task++) {
        const int64_t b = task / H, h = task % H, grp = h / per_group;
        float *S = state_out + task * P * N;
        const float *src = state_in + task * P * N;
        const float a = A[h], skip = D ? D[h] : 0.0f;
        for (int64_t t = 0; t < T; t++) {
            const int64_t row = b * T + t;
            const float step = dt[row * H + h];
            const float decay = expf(step * a);
            const float *restrict xt = x + (row * H + h) * P;
            const float *restrict bt = Bm + (row * G + grp) * N;
            const float *restrict ct = C + (row * G + grp) * N;
            float *restrict yt = y + (row * H + h) * P;
            for (int64_t p = 0; p < P; p++) {
                const float *sp = src + p * N; /* may be dp */
                float *dp = S + p * N;
                const float w = step * xt[p];
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t n = 0; n < N; n++) {
                    const float s = sp[n] * decay + w * bt[n];
                    dp[n] = s;
                    acc += s * ct[n];
                }
                yt[p] = acc + skip * xt[p];
            }
            src = S;
        }
        if (T == 0 && S != src) memcpy(S, src, (size_t)(P * N) * sizeof(float));
    }
}
