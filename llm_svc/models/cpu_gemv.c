/* Linears of a few rows (decode steps): out[m, n] = x[m, :] . w[n, :] + bias[n], float32.
 *
 * With 1-8 rows a linear is bound by streaming its weight once from memory; oneDNN's GEMM for
 * such shapes reached 3-8 GB/s on the 2-core dev VMs. Here each weight row is read once for all
 * rows of x (x stays in L1), two weight rows at a time against four x rows (8 accumulators),
 * and the output rows are split into blocks over OpenMP threads (torch's own libgomp: the same
 * runtime, no second thread pool).
 *
 * x [M, K] with row stride ldx; w [N, K] contiguous; bias [N] or NULL; out [M, N] with row
 * stride ldo. Returns 0.
 */
#include <stdint.h>
#include <stddef.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define GEMV_AVX512 1
#ifndef GEMV_PREFETCH
#define GEMV_PREFETCH 4 * K
#endif
#endif

#define BLOCK_ROWS 32 /* weight rows per work item: 32 x K floats (64 KB at K = 512) */

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}
#endif

static __attribute__((unused)) void rows(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t ldo,
                 int64_t M, int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1;
        const float* w0 = w + n * K;
        const float* w1 = two ? w0 + K : w0;
        const float b0 = bias ? bias[n] : 0.f, b1 = bias && two ? bias[n + 1] : 0.f;
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t mm = M - m < 4 ? M - m : 4;
            const float* xs[4];
            for (int j = 0; j < 4; j++) xs[j] = x + (m + (j < mm ? j : 0)) * ldx;
            float r0[4] = {0.f, 0.f, 0.f, 0.f}, r1[4] = {0.f, 0.f, 0.f, 0.f};
            int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
            __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
            for (; k + 8 <= K; k += 8) {
                const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
                const __m256 y0 = _mm256_loadu_ps(xs[0] + k), y1 = _mm256_loadu_ps(xs[1] + k);
                const __m256 y2 = _mm256_loadu_ps(xs[2] + k), y3 = _mm256_loadu_ps(xs[3] + k);
                a00 = _mm256_fmadd_ps(v0, y0, a00); a01 = _mm256_fmadd_ps(v0, y1, a01);
                a02 = _mm256_fmadd_ps(v0, y2, a02); a03 = _mm256_fmadd_ps(v0, y3, a03);
                a10 = _mm256_fmadd_ps(v1, y0, a10); a11 = _mm256_fmadd_ps(v1, y1, a11);
                a12 = _mm256_fmadd_ps(v1, y2, a12); a13 = _mm256_fmadd_ps(v1, y3, a13);
            }
            r0[0] = hsum8(a00); r0[1] = hsum8(a01); r0[2] = hsum8(a02); r0[3] = hsum8(a03);
            r1[0] = hsum8(a10); r1[1] = hsum8(a11); r1[2] = hsum8(a12); r1[3] = hsum8(a13);
#endif
            for (; k < K; k++) { /* the tail (and the whole row without AVX2) */
                for (int j = 0; j < 4; j++) {
                    r0[j] += w0[k] * xs[j][k];
                    r1[j] += w1[k] * xs[j][k];
                }
            }
            for (int64_t j = 0; j < mm; j++) {
                out[(m + j) * ldo + n] = r0[j] + b0;
                if (two) out[(m + j) * ldo + n + 1] = r1[j] + b1;
            }
        }
    }
}

#ifdef GEMV_AVX512
/* AVX-512: four weight rows against up to four x rows (16 accumulators of 16 lanes), so each
 * 64-byte weight load feeds as many FMAs as there are x rows and the x rows (L1) are loaded once
 * per four weight rows; K tails by a masked load. MM is a compile-time row count (1-4): a call
 * of 1-3 rows does no wasted FMAs. On an AVX-512 Xeon (one thread, 64 distinct weights) the AVX2
 * tile below was 1.5-1.9x slower than oneDNN; this one is not. */
static inline __attribute__((always_inline)) void tile512(const float* const* xs, const float* w, int64_t K,
                                                         int nw, int MM, float r[4][4]) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    const float* ws[4];
    for (int i = 0; i < 4; i++) ws[i] = w + (i < nw ? i : 0) * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 y[4];
        for (int j = 0; j < MM; j++) y[j] = _mm512_loadu_ps(xs[j] + k);
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char*)(ws[i] + k + GEMV_PREFETCH), _MM_HINT_T0);
            const __m512 v = _mm512_loadu_ps(ws[i] + k);
            for (int j = 0; j < MM; j++) acc[i][j] = _mm512_fmadd_ps(v, y[j], acc[i][j]);
        }
    }
    if (k < K) {
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        __m512 y[4];
        for (int j = 0; j < MM; j++) y[j] = _mm512_maskz_loadu_ps(mask, xs[j] + k);
        for (int i = 0; i < 4; i++) {
            const __m512 v = _mm512_maskz_loadu_ps(mask, ws[i] + k);
            for (int j = 0; j < MM; j++) acc[i][j] = _mm512_fmadd_ps(v, y[j], acc[i][j]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < MM; j++) r[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

static void rows512(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t ldo,
                    int64_t M, int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 4) {
        const int nw = n1 - n < 4 ? (int)(n1 - n) : 4;
        for (int64_t m = 0; m < M; m += 4) {
            const int mm = M - m < 4 ? (int)(M - m) : 4;
            const float* xs[4];
            for (int j = 0; j < 4; j++) xs[j] = x + (m + (j < mm ? j : 0)) * ldx;
            float r[4][4];
            switch (mm) {
                case 1: tile512(xs, w + n * K, K, nw, 1, r); break;
                case 2: tile512(xs, w + n * K, K, nw, 2, r); break;
                case 3: tile512(xs, w + n * K, K, nw, 3, r); break;
                default: tile512(xs, w + n * K, K, nw, 4, r); break;
            }
            for (int i = 0; i < nw; i++) {
                const float b = bias ? bias[n + i] : 0.f;
                for (int j = 0; j < mm; j++) out[(m + j) * ldo + n + i] = r[i][j] + b;
            }
        }
    }
}
#define ROWS rows512
#else
#define ROWS rows
#endif

int mmserve_gemv_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t ldo,
                     int64_t M, int64_t N, int64_t K, int64_t threads) {
    const int64_t blocks = (N + BLOCK_ROWS - 1) / BLOCK_ROWS;
    if (threads <= 1 || blocks < 2) {
        ROWS(x, ldx, w, bias, out, ldo, M, K, 0, N);
        return 0;
    }
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < N ? n0 + BLOCK_ROWS : N;
        ROWS(x, ldx, w, bias, out, ldo, M, K, n0, n1);
    }
    return 0;
}

/* Routed experts of a few tokens (decode steps), one call for the whole MoE layer:
 *   out[t] = sum over k of w[t, k] * down[e] . (silu(gate[e] . x[t]) * (up[e] . x[t])), e = idx[t, k]
 * x [T, H] contiguous; idx [T, K] int64; w [T, K]; gate_up [E, 2I, H] (gate rows then up rows);
 * down [E, H, I]; out [T, H]. Each expert with tokens runs its two few-row products on its own
 * rows (a weight is streamed once per step however many of the step's tokens chose it); threads
 * split the experts, and the tokens' sums are taken afterwards in ascending expert order, so the
 * result does not depend on the thread count. Returns 0, or 1 if an index is out of range or
 * memory is short (out untouched). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* e^-v for the sigmoid and SiLU: -ffast-math assumes no infinities, so expf is kept finite
 * (1 / (1 + e^80) is 0 in float) */
static inline float exp_neg(float v) { return expf(fminf(-v, 80.f)); }

int mmserve_moe_f32(const float* x, int64_t T, int64_t H, const int64_t* idx, const float* w, int64_t K,
                    const float* gate_up, const float* down, int64_t E, int64_t I, float* out, int64_t threads) {
    const int64_t P = T * K;
    for (int64_t p = 0; p < P; p++)
        if (idx[p] < 0 || idx[p] >= E) return 1;
    int64_t* start = calloc(2 * (size_t)E + 1, sizeof(int64_t)); /* E + 1 offsets, then E fill counts */
    int64_t* pair = malloc((size_t)(P ? P : 1) * sizeof(int64_t)); /* pairs grouped by expert, token order inside */
    float* xs = malloc((size_t)(P ? P : 1) * (size_t)H * sizeof(float));
    float* gu = malloc((size_t)(P ? P : 1) * (size_t)(2 * I) * sizeof(float));
    float* ys = malloc((size_t)(P ? P : 1) * (size_t)H * sizeof(float));
    if (!start || !pair || !xs || !gu || !ys) {
        free(start); free(pair); free(xs); free(gu); free(ys);
        return 1;
    }
    for (int64_t p = 0; p < P; p++) start[idx[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t* fill = start + E + 1;
    for (int64_t p = 0; p < P; p++) pair[start[idx[p]] + fill[idx[p]]++] = p;
    for (int64_t r = 0; r < P; r++) memcpy(xs + r * H, x + (pair[r] / K) * H, (size_t)H * sizeof(float));
#pragma omp parallel for num_threads((int)(threads > 1 ? threads : 1)) schedule(dynamic, 1) if (threads > 1)
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = start[e], c = start[e + 1] - r0;
        if (!c) continue;
        float* g = gu + r0 * 2 * I;
        ROWS(xs + r0 * H, H, gate_up + e * 2 * I * H, NULL, g, 2 * I, c, H, 0, 2 * I);
        for (int64_t j = 0; j < c; j++) { /* the activation in place over the gate half */
            float* row = g + j * 2 * I;
            for (int64_t i = 0; i < I; i++) {
                row[i] = row[i] / (1.f + exp_neg(row[i])) * row[I + i]; /* silu(gate) * up */
            }
        }
        ROWS(g, 2 * I, down + e * H * I, NULL, ys + r0 * H, H, c, I, 0, H);
    }
    memset(out, 0, (size_t)T * (size_t)H * sizeof(float));
    for (int64_t r = 0; r < P; r++) {
        const int64_t p = pair[r];
        const float s = w[p];
        float* o = out + (p / K) * H;
        const float* y = ys + r * H;
        for (int64_t h = 0; h < H; h++) o[h] += y[h] * s;
    }
    free(start); free(pair); free(xs); free(gu); free(ys);
    return 0;
}

/* MiMo's router for a few tokens (one group: n_group = 1): scores = sigmoid(x . wr[e]); the K
 * experts of highest score + bias[e] (bias steers the choice only), in descending order, ties to
 * the lower index; weights = their raw scores, divided by their sum when norm, times scale.
 * x [T, H]; wr [E, H]; bias [E] or NULL; idx [T, K] int64 out; w [T, K] out. Returns 0, 1 if
 * K > E or E > 256. */
int mmserve_route_f32(const float* x, int64_t T, int64_t H, const float* wr, const float* bias, int64_t E,
                      int64_t K, int64_t norm, float scale, int64_t* idx, float* w) {
    if (K > E || E > 256) return 1;
    float s[256], c[256];
    unsigned char taken[256]; /* not a NaN mark: -ffast-math assumes there are none */
    for (int64_t t = 0; t < T; t++) {
        memset(taken, 0, sizeof taken);
        ROWS(x + t * H, H, wr, NULL, s, E, 1, H, 0, E);
        for (int64_t e = 0; e < E; e++) {
            s[e] = 1.f / (1.f + exp_neg(s[e]));
            c[e] = s[e] + (bias ? bias[e] : 0.f);
        }
        float sum = 0.f;
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || c[e] > c[best])) best = e;
            idx[t * K + k] = best;
            w[t * K + k] = s[best];
            sum += s[best];
            taken[best] = 1;
        }
        for (int64_t k = 0; k < K; k++) {
            float v = w[t * K + k];
            if (norm) v = v / (sum + 1e-20f);
            w[t * K + k] = v * scale;
        }
    }
    return 0;
}

/* silu(gate) * up of a gated MLP's fused projection: gu [T, 2I] (gate | up, row stride ld) ->
 * out [T, I] (contiguous), rows over threads. */
int mmserve_silu_mul_f32(const float* gu, int64_t ld, float* out, int64_t T, int64_t I, int64_t threads) {
#pragma omp parallel for num_threads((int)(threads > 1 ? threads : 1)) schedule(static) if (threads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const float* g = gu + t * ld;
        const float* u = g + I;
        float* o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + exp_neg(g[i])) * u[i];
    }
    return 0;
}
