/* The element-wise work between a layer's GEMMs, one pass each (float32, rows over OpenMP).
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
 */
#include <math.h>
#include <stdint.h>

static int64_t nthreads(int64_t threads, int64_t rows) {
    if (threads < 1) threads = 1;
    return rows < threads ? (rows < 1 ? 1 : rows) : threads;
}

int mmserve_qkv_post_f32(float* x, int64_t T, int64_t ld, int64_t hq, int64_t hk, int64_t d, int64_t dv,
                         int64_t r, const float* cos, const float* sin, int64_t ldc, float vscale,
                         int apply_vscale, int64_t threads) {
    if (r % 2 || r > d) return 1;
    const int64_t half = r / 2, heads = hq + hk;
#pragma omp parallel for num_threads((int)nthreads(threads, T)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float* row = x + t * ld;
        const float* c = cos + t * ldc;
        const float* s = sin + t * ldc;
        for (int64_t h = 0; h < heads; h++) {
            float* p = row + h * d;
            for (int64_t i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                const float lo_c = a * c[i], lo_s = -b * s[i];
                const float hi_c = b * c[i + half], hi_s = a * s[i + half];
                p[i] = lo_c + lo_s;
                p[i + half] = hi_c + hi_s;
            }
        }
        if (apply_vscale) {
            float* v = row + heads * d;
            for (int64_t i = 0; i < hk * dv; i++) v[i] = v[i] * vscale;
        }
    }
    return 0;
}

int mmserve_add_rmsnorm_f32(float* h, int64_t ldh, const float* y, int64_t ldy, const float* w, float* out,
                            int64_t T, int64_t H, float eps, int64_t threads) {
#pragma omp parallel for num_threads((int)nthreads(threads, T)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float* hr = h + t * ldh;
        float* o = out + t * H;
        if (y) {
            const float* yr = y + t * ldy;
            for (int64_t i = 0; i < H; i++) hr[i] = hr[i] + yr[i];
        }
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
            for (int j = 0; j < 8; j++) lane[j] += hr[i + j] * hr[i + j];
        float ss = 0.f;
        for (; i < H; i++) ss += hr[i] * hr[i];
        for (int j = 0; j < 8; j++) ss += lane[j];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t k = 0; k < H; k++) o[k] = w[k] * (hr[k] * inv);
    }
    return 0;
}
