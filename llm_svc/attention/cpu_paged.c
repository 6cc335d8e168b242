/* Paged decode attention on the CPU: one query per sequence, K/V read in place from the pool.
 *
 * Pools are head-major, as llm_svc.attention.base.LayerKV holds them:
 *   k [Hkv, S, Dqk], v [Hkv, S, Dv]  (float32, contiguous)
 * Sequence b's context is the slot-table run table[trows[b], k0[b] .. k0[b] + lens[b] - 1]
 * (k0 NULL: from 0), read in place like the pools: nothing is gathered.
 * Work item = (sequence b, kv head h): the G = Hq / Hkv query heads of h read each K and V row
 * once (GQA). Keys go in blocks of BLK with an online softmax, so the scores stay in L1.
 * Sinks (MiMo): an extra logit per query head with no value, added to the denominator.
 * Soft-cap (Gemma 2 style): s = cap * tanh(s / cap) before the softmax.
 * Built by cpu_paged.py with -O3 -ffast-math -march=native; no OpenMP (torch brings its own
 * runtime): the caller splits [item_begin, item_end) across threads.
 */
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef BLK
#define BLK 512 /* keys per softmax block: long blocks keep the K and V streams long (measured 64 -> 512: 28 -> 18 ms at 16 x 32K) */
#endif

static inline __attribute__((always_inline)) int decode_body(
    const float *q,        /* [B, Hq, Dqk] */
    const float *kpool,    /* [Hkv, S, Dqk] */
    const float *vpool,    /* [Hkv, S, Dv] */
    const int64_t *table,  /* [R, ld_slots] slot table */
    const int64_t *trows,  /* [B] its row of each sequence */
    const int64_t *k0,     /* [B] first key's position, or NULL (all 0) */
    const int64_t *lens,   /* [B] */
    const float *sinks,    /* [Hq] or NULL */
    float *out,            /* [B, Hq, Dv] */
    int64_t B, int64_t Hq, int64_t Hkv, int64_t Dqk, int64_t Dv, int64_t S, int64_t ld_slots,
    float scale, float softcap, int64_t item_begin, int64_t item_end)
{
    const int64_t G = Hq / Hkv;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(G * BLK + G * Dv + 2 * G));
    if (!buf) return -1;
    float *sc = buf;               /* [G, BLK] scores, then probabilities */
    float *acc = sc + G * BLK;     /* [G, Dv] */
    float *mx = acc + G * Dv;      /* [G] running max */
    float *den = mx + G;           /* [G] running sum */
    (void)B;
    for (int64_t it = item_begin; it < item_end; ++it) {
        const int64_t b = it / Hkv, h = it % Hkv;
        const int64_t L = lens[b];
        const int64_t *sl = table + trows[b] * ld_slots + (k0 ? k0[b] : 0);
        const float *qh = q + (b * Hq + h * G) * Dqk;
        const float *kh = kpool + h * S * Dqk;
        const float *vh = vpool + h * S * Dv;
        memset(acc, 0, sizeof(float) * (size_t)(G * Dv));
        for (int64_t i = 0; i < G; ++i) { mx[i] = -1e30f; den[i] = 0.f; }
        for (int64_t j0 = 0; j0 < L; j0 += BLK) {
            const int64_t n = L - j0 < BLK ? L - j0 : BLK;
            /* pages are scattered: fetch the next block's rows while this one computes */
            const int64_t pf = L - j0 - BLK < BLK ? L - j0 - BLK : BLK;
            for (int64_t t = 0; t < pf; ++t) {
                const char *kn = (const char *)(kh + sl[j0 + BLK + t] * Dqk);
                const char *vn = (const char *)(vh + sl[j0 + BLK + t] * Dv);
                for (int64_t o = 0; o < Dqk * 4; o += 64) __builtin_prefetch(kn + o);
                for (int64_t o = 0; o < Dv * 4; o += 64) __builtin_prefetch(vn + o);
            }
            int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
            if (Dqk % 8 == 0) {
                for (; t + 8 <= n; t += 8) {
                    const float *kr[8];
                    for (int u = 0; u < 8; ++u) kr[u] = kh + sl[j0 + t + u] * Dqk;
                    for (int64_t i = 0; i < G; ++i) {
                        const float *qi = qh + i * Dqk;
                        __m256 a[8];
                        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
                        for (int64_t d = 0; d < Dqk; d += 8) {
                            const __m256 qv = _mm256_loadu_ps(qi + d);
                            for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[u] + d), a[u]);
                        }
                        /* 8 dot products -> one vector: three rounds of pairwise adds */
                        const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
                        const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
                        const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
                        __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                                                 _mm256_permute2f128_ps(s03, s47, 0x31));
                        r = _mm256_mul_ps(r, _mm256_set1_ps(scale));
                        _mm256_storeu_ps(sc + i * BLK + t, r);
                    }
                }
                if (softcap > 0.f)
                    for (int64_t i = 0; i < G; ++i)
                        for (int64_t u = 0; u < t; ++u) sc[i * BLK + u] = softcap * tanhf(sc[i * BLK + u] / softcap);
            }
#endif
            for (; t < n; ++t) {
                const float *kr = kh + sl[j0 + t] * Dqk;
                for (int64_t i = 0; i < G; ++i) {
                    const float *qi = qh + i * Dqk;
                    float s = 0.f;
                    for (int64_t d = 0; d < Dqk; ++d) s += qi[d] * kr[d];
                    s *= scale;
                    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                    sc[i * BLK + t] = s;
                }
            }
            for (int64_t i = 0; i < G; ++i) {
                float *si = sc + i * BLK;
                float m = mx[i];
                for (int64_t t = 0; t < n; ++t) m = si[t] > m ? si[t] : m;
                const float corr = expf(mx[i] - m); /* 0 on the first block (-1e30: -ffast-math has no inf) */
                float sum = 0.f;
                for (int64_t t = 0; t < n; ++t) { si[t] = expf(si[t] - m); sum += si[t]; }
                den[i] = den[i] * corr + sum;
                mx[i] = m;
                if (corr != 1.f) {
                    float *ai = acc + i * Dv;
                    for (int64_t d = 0; d < Dv; ++d) ai[d] *= corr;
                }
            }
            /* heads outer, keys inner: the accumulator stays in registers (keys outer kept it in
             * memory: a store -> load chain per key, half the kernel's time at Dv = 16) */
            for (int64_t i = 0; i < G; ++i) {
                const float *si = sc + i * BLK;
                float *ai = acc + i * Dv;
                int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
                for (; d0 + 8 <= Dv; d0 += 64) { /* up to 8 vectors of the output row in registers */
                    const int nv = (int)((Dv - d0) / 8 < 8 ? (Dv - d0) / 8 : 8);
                    __m256 a[8];
                    for (int c = 0; c < nv; ++c) a[c] = _mm256_loadu_ps(ai + d0 + 8 * c);
                    for (int64_t t = 0; t < n; ++t) {
                        const float *vr = vh + sl[j0 + t] * Dv + d0;
                        const __m256 pv = _mm256_set1_ps(si[t]);
                        for (int c = 0; c < nv; ++c) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), a[c]);
                    }
                    for (int c = 0; c < nv; ++c) _mm256_storeu_ps(ai + d0 + 8 * c, a[c]);
                    if (nv < 8) { d0 += 8 * nv; break; }
                }
#endif
                for (int64_t t = 0; t < n && d0 < Dv; ++t) {
                    const float *vr = vh + sl[j0 + t] * Dv;
                    const float p = si[t];
                    for (int64_t d = d0; d < Dv; ++d) ai[d] += p * vr[d];
                }
            }
        }
        for (int64_t i = 0; i < G; ++i) {
            float d0 = den[i];
            if (sinks && L > 0) d0 += expf(sinks[h * G + i] - mx[i]);
            const float inv = d0 > 0.f ? 1.f / d0 : 0.f;
            float *o = out + (b * Hq + h * G + i) * Dv;
            const float *ai = acc + i * Dv;
            for (int64_t d = 0; d < Dv; ++d) o[d] = ai[d] * inv;
        }
    }
    free(buf);
    return 0;
}

#define SPEC(DQ, DV) \
    static int decode_##DQ##_##DV(const float *q, const float *k, const float *v, const int64_t *tb, \
                                  const int64_t *tr, const int64_t *k0, const int64_t *lens, const float *sinks, float *out, int64_t B, int64_t Hq, \
                                  int64_t Hkv, int64_t S, int64_t ld, float scale, float cap, int64_t a, int64_t e) \
    { return decode_body(q, k, v, tb, tr, k0, lens, sinks, out, B, Hq, Hkv, DQ, DV, S, ld, scale, cap, a, e); }
SPEC(16, 16) SPEC(24, 16) SPEC(32, 32) SPEC(48, 48) SPEC(64, 64) SPEC(80, 80) SPEC(96, 96)
SPEC(128, 128) SPEC(192, 128) SPEC(256, 256)

/* Head sizes known at compile time unroll and vectorize the dot products (measured ~2x at 24);
 * other sizes take the generic body. */
int mmserve_paged_decode_f32(
    const float *q, const float *kpool, const float *vpool, const int64_t *table, const int64_t *trows,
    const int64_t *k0, const int64_t *lens, const float *sinks, float *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t Dqk, int64_t Dv, int64_t S,
    int64_t ld_slots, float scale, float softcap, int64_t item_begin, int64_t item_end)
{
#define TRY(DQ, DV) \
    if (Dqk == DQ && Dv == DV) \
        return decode_##DQ##_##DV(q, kpool, vpool, table, trows, k0, lens, sinks, out, B, Hq, Hkv, S, ld_slots, scale, \
                                  softcap, item_begin, item_end);
    TRY(16, 16) TRY(24, 16) TRY(32, 32) TRY(48, 48) TRY(64, 64) TRY(80, 80) TRY(96, 96)
    TRY(128, 128) TRY(192, 128) TRY(256, 256)
#undef TRY
    return decode_body(q, kpool, vpool, table, trows, k0, lens, sinks, out, B, Hq, Hkv, Dqk, Dv, S, ld_slots, scale, softcap,
                       item_begin, item_end);
}
