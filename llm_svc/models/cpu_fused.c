/* The element-wise work between a layer's GEMMs, one pass each (float32; blocks of rows on the
 * few-row kernel's pool, cpu_gemv.c's par_for, passed in: OpenMP's team slept between these
 * short passes once the GEMMs left it, and waking it was ~15% of a 320-token MiMo prefill).
 *
 * qkv_post: a fused q|k|v projection's rows [T, (Hq + Hk) * D + Hk * Dv] (row stride ld), in
 *   place: rope on the first R dims of every q and k head (rotate-half form, cos / sin [T, R]
 *   whose two halves are equal, as transformers' tables are), v times vscale. The same
 *   operations in the same order as torch's eager ``x * cos + rotate_half(x) * sin`` and
 *   ``v * scale``: this file is built without -ffast-math and without contraction, so each
 *   product and sum is rounded as torch rounds it, and the result is bit-identical.
 * add_rmsnorm: h += y (in place), out = rmsnorm(h) * w: a residual add and the next norm in
 *   one read of h (the sum of squares in float, the rsqrt of its mean + eps).
 *   The sum runs in 8 lanes (vectorized without reassociating: this file has no -ffast-math).
 *
 * Activations (rows, tables, norm weights) are float32, or bfloat16 in the -DACT_BF16 build
 * (../attention/act_elem.h): each value is widened to float32, and every eager bfloat16 op's
 * result is rounded as torch rounds it (round to nearest even, per op), so
 *   qkv_post:    p = bf(bf(x0 * c) + bf(-x1 * s)), v = bf(v * vscale)   (bit-identical to eager bf16)
 *   add_rmsnorm: h = bf(h + y), out = bf(w * bf(h * rsqrt(mean(h^2) + eps)))   (mimo_blocks.RMSNorm at
 *                bf16: the mean in float32, summed in another order than torch's: within an ulp)
 *   add_rmsnorm_w32: h = bf(h + y), out = bf(w32 * (h * rsqrt(...)))  (Gemma3RMSNorm at bf16: a float32
 *                (1 + weight), one rounding)
 */
#include <math.h>
#include <stdint.h>
#include "../attention/act_elem.h"

typedef void (*chunk_fn_t)(void* ctx, int64_t i);
typedef void (*par_for_t)(chunk_fn_t fn, void* ctx, int64_t n, int64_t threads);

#define BLOCK 16 /* rows per work item */

/* fn over row blocks [0, T): on par_for with up to `threads` threads, or inline */
static void over_rows(chunk_fn_t fn, void* ctx, int64_t T, par_for_t par_for, int64_t threads) {
    const int64_t n = (T + BLOCK - 1) / BLOCK;
    if (par_for && threads > 1 && n > 1) par_for(fn, ctx, n, threads);
    else
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
}

typedef struct {
    act_t* x;
    const act_t *cos, *sin;
    int64_t T, ld, heads, d, dv, hk, half, ldc;
    float vscale;
    int apply_vscale;
} qkv_ctx;

#if ACT_IS_F32
static void qkv_rows(void* vctx, int64_t b) {
    const qkv_ctx* a = vctx;
    const int64_t t1 = (b + 1) * BLOCK < a->T ? (b + 1) * BLOCK : a->T;
    for (int64_t t = b * BLOCK; t < t1; t++) {
        float* row = a->x + t * a->ld;
        const float* c = a->cos + t * a->ldc;
        const float* s = a->sin + t * a->ldc;
        const int64_t half = a->half;
        for (int64_t h = 0; h < a->heads; h++) {
            float* p = row + h * a->d;
            for (int64_t i = 0; i < half; i++) {
                const float x0 = p[i], x1 = p[i + half];
                const float lo_c = x0 * c[i], lo_s = -x1 * s[i];
                const float hi_c = x1 * c[i + half], hi_s = x0 * s[i + half];
                p[i] = lo_c + lo_s;
                p[i + half] = hi_c + hi_s;
            }
        }
        if (a->apply_vscale) {
            float* v = row + a->heads * a->d;
            for (int64_t i = 0; i < a->hk * a->dv; i++) v[i] = v[i] * a->vscale;
        }
    }
}
#else
#define CH 128 /* rope / v elements per stack chunk */
static void qkv_rows(void* vctx, int64_t b) {
    const qkv_ctx* a = vctx;
    const int64_t t1 = (b + 1) * BLOCK < a->T ? (b + 1) * BLOCK : a->T;
    float x[2 * CH], c[2 * CH], s[2 * CH], u[2 * CH], w[2 * CH];
    for (int64_t t = b * BLOCK; t < t1; t++) {
        act_t* row = a->x + t * a->ld;
        const int64_t half = a->half;
        for (int64_t i0 = 0; i0 < half; i0 += CH) {
            const int64_t n = half - i0 < CH ? half - i0 : CH;
            act_load_row(c, a->cos + t * a->ldc + i0, n);
            act_load_row(c + n, a->cos + t * a->ldc + half + i0, n);
            act_load_row(s, a->sin + t * a->ldc + i0, n);
            act_load_row(s + n, a->sin + t * a->ldc + half + i0, n);
            for (int64_t h = 0; h < a->heads; h++) {
                act_t* p = row + h * a->d;
                act_load_row(x, p + i0, n);
                act_load_row(x + n, p + half + i0, n);
                for (int64_t i = 0; i < n; i++) {
                    u[i] = x[i] * c[i];              /* x * cos, low half */
                    w[i] = -x[n + i] * s[i];         /* rotate_half(x) * sin */
                    u[n + i] = x[n + i] * c[n + i];
                    w[n + i] = x[i] * s[n + i];
                }
                act_round_row(u, 2 * n);
                act_round_row(w, 2 * n);
                for (int64_t i = 0; i < 2 * n; i++) u[i] = u[i] + w[i];
                act_store_row(p + i0, u, n);
                act_store_row(p + half + i0, u + n, n);
            }
        }
        if (a->apply_vscale) {
            act_t* v = row + a->heads * a->d;
            const int64_t nv = a->hk * a->dv;
            for (int64_t i0 = 0; i0 < nv; i0 += 2 * CH) {
                const int64_t n = nv - i0 < 2 * CH ? nv - i0 : 2 * CH;
                act_load_row(x, v + i0, n);
                for (int64_t i = 0; i < n; i++) x[i] = x[i] * a->vscale;
                act_store_row(v + i0, x, n);
            }
        }
    }
}
#endif

int mmserve_qkv_post_f32(act_t* x, int64_t T, int64_t ld, int64_t hq, int64_t hk, int64_t d, int64_t dv,
                         int64_t r, const act_t* cos, const act_t* sin, int64_t ldc, float vscale,
                         int apply_vscale, par_for_t par_for, int64_t threads) {
    if (r % 2 || r > d) return 1;
    qkv_ctx a = {x, cos, sin, T, ld, hq + hk, d, dv, hk, r / 2, ldc, vscale, apply_vscale};
    over_rows(qkv_rows, &a, T, par_for, threads);
    return 0;
}

typedef struct {
    act_t* h;
    const act_t *y, *w;
    act_t* out;
    int64_t T, ldh, ldy, H;
    float eps;
    const float* w32; /* add_rmsnorm_w32: a float32 weight, the product rounded once (else NULL) */
} norm_ctx;

#if ACT_IS_F32
static void norm_rows(void* vctx, int64_t b) {
    const norm_ctx* a = vctx;
    const int64_t H = a->H, t1 = (b + 1) * BLOCK < a->T ? (b + 1) * BLOCK : a->T;
    for (int64_t t = b * BLOCK; t < t1; t++) {
        float* hr = a->h + t * a->ldh;
        float* o = a->out + t * H;
        if (a->y) {
            const float* yr = a->y + t * a->ldy;
            for (int64_t i = 0; i < H; i++) hr[i] = hr[i] + yr[i];
        }
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
            for (int j = 0; j < 8; j++) lane[j] += hr[i + j] * hr[i + j];
        float ss = 0.f;
        for (; i < H; i++) ss += hr[i] * hr[i];
        for (int j = 0; j < 8; j++) ss += lane[j];
        const float inv = 1.0f / sqrtf(ss / (float)H + a->eps);
        const float* w = a->w32 ? a->w32 : a->w;
        for (int64_t k = 0; k < H; k++) o[k] = w[k] * (hr[k] * inv);
    }
}
#else
static void norm_rows(void* vctx, int64_t b) {
    const norm_ctx* a = vctx;
    const int64_t H = a->H, t1 = (b + 1) * BLOCK < a->T ? (b + 1) * BLOCK : a->T;
    float x[2 * CH], y[2 * CH];
    for (int64_t t = b * BLOCK; t < t1; t++) {
        act_t* hr = a->h + t * a->ldh;
        act_t* o = a->out + t * H;
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        float ss = 0.f;
        for (int64_t i0 = 0; i0 < H; i0 += 2 * CH) { /* h = bf(h + y), and the sum of its squares */
            const int64_t n = H - i0 < 2 * CH ? H - i0 : 2 * CH;
            act_load_row(x, hr + i0, n);
            if (a->y) {
                act_load_row(y, a->y + t * a->ldy + i0, n);
                for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
                act_round_row(x, n);
                act_store_row(hr + i0, x, n);
            }
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                for (int j = 0; j < 8; j++) lane[j] += x[i + j] * x[i + j];
            for (; i < n; i++) ss += x[i] * x[i];
        }
        for (int j = 0; j < 8; j++) ss += lane[j];
        const float inv = 1.0f / sqrtf(ss / (float)H + a->eps);
        for (int64_t i0 = 0; i0 < H && a->w32; i0 += 2 * CH) { /* Gemma: bf((h * inv) * w32), one rounding */
            const int64_t n = H - i0 < 2 * CH ? H - i0 : 2 * CH;
            act_load_row(x, hr + i0, n);
            for (int64_t i = 0; i < n; i++) x[i] = (x[i] * inv) * a->w32[i0 + i];
            act_store_row(o + i0, x, n);
        }
        for (int64_t i0 = 0; i0 < H && !a->w32; i0 += 2 * CH) {
            const int64_t n = H - i0 < 2 * CH ? H - i0 : 2 * CH;
            act_load_row(x, hr + i0, n);
            act_load_row(y, a->w + i0, n);
            for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv;
            act_round_row(x, n); /* h.to(bfloat16) */
            for (int64_t i = 0; i < n; i++) x[i] = y[i] * x[i];
            act_store_row(o + i0, x, n);
        }
    }
}
#endif

int mmserve_add_rmsnorm_f32(act_t* h, int64_t ldh, const act_t* y, int64_t ldy, const act_t* w, act_t* out,
                            int64_t T, int64_t H, float eps, par_for_t par_for, int64_t threads) {
    norm_ctx a = {h, y, w, out, T, ldh, ldy, H, eps, NULL};
    over_rows(norm_rows, &a, T, par_for, threads);
    return 0;
}

/* add_rmsnorm with a float32 weight whatever the activations' dtype, out = act(w32 * (h * inv)):
 * Gemma3RMSNorm, which normalizes and multiplies by (1 + weight) in float32 and rounds once */
int mmserve_add_rmsnorm_w32(act_t* h, int64_t ldh, const act_t* y, int64_t ldy, const float* w32, act_t* out,
                            int64_t T, int64_t H, float eps, par_for_t par_for, int64_t threads) {
    norm_ctx a = {h, y, NULL, out, T, ldh, ldy, H, eps, w32};
    over_rows(norm_rows, &a, T, par_for, threads);
    return 0;
}
