/* Paged decode attention on the CPU: one query per sequence, K/V read in place from the pool.
 *
 * Pools are head-major, as llm_svc.attention.base.LayerKV holds them:
 *   k [Hkv, S, Dqk], v [Hkv, S, Dv]  (contiguous; float32, or with -DKV_BF16 / -DKV_F16 a build
 *   for bfloat16 / float16 pools whose rows are widened to float32 as they are loaded: half the
 *   bytes to read, and decodes over long contexts are bound by that read)
 * Sequence b's context is the slot-table run table[trows[b], k0[b] .. k0[b] + lens[b] - 1]
 * (k0 NULL: from 0), read in place like the pools: nothing is gathered.
 * Work item = (sequence b, kv head h): the G = Hq / Hkv query heads of h read each K and V row
 * once (GQA). Keys go in blocks of BLK with an online softmax, so the scores stay in L1.
 * Sinks (MiMo): an extra logit per query head with no value, added to the denominator.
 * Soft-cap (Gemma 2 style): s = cap * tanh(s / cap) before the softmax.
 * AVX-512 (16 keys a block, a 16-way transposing reduce) where the CPU has it, AVX2 (8 keys)
 * for what is left or where it has not, scalar for the rest.
 * Built by cpu_paged.py with -O3 -ffast-math -march=native; no OpenMP (torch brings its own
 * runtime): the caller splits [item_begin, item_end) across threads.
 */
#include <math.h>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The pools' element type (one build each) and its vector loads widened to float32. */
#include "kv_elem.h"
/* The activations' (queries, output, the KV write's rows): float32, or bfloat16 with -DACT_BF16:
 * an item's queries are widened once into scratch, its output rows rounded as they are stored. */
#include "act_elem.h"
#if defined(KV_BF16)
#if defined(__AVX512F__)
static inline __m512 ld16(const kv_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 ld8(const kv_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
#elif defined(KV_F16)
#if defined(__AVX512F__)
static inline __m512 ld16(const kv_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 ld8(const kv_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif
#else
#if defined(__AVX512F__)
static inline __m512 ld16(const kv_t *p) { return _mm512_loadu_ps(p); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 ld8(const kv_t *p) { return _mm256_loadu_ps(p); }
#endif
#endif

#ifndef BLK
#define BLK 512 /* keys per softmax block: long blocks keep the K and V streams long (measured 64 -> 512: 28 -> 18 ms at 16 x 32K) */
#endif

#if defined(__AVX512F__)
/* 16 accumulators -> one vector of their 16 lane sums, in order: halves, then 128-bit blocks,
 * then within blocks (unpack ps, unpack pd), then one permute (lane 4j + m holds key j + 4m). */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *a)
{
    __m512 b[8], c[4], d[2];
    for (int u = 0; u < 8; ++u)
        b[u] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0xEE));
    for (int u = 0; u < 4; ++u)
        c[u] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * u], b[2 * u + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * u], b[2 * u + 1], 0xDD));
    for (int u = 0; u < 2; ++u)
        d[u] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * u], c[2 * u + 1]), _mm512_unpackhi_ps(c[2 * u], c[2 * u + 1]));
    const __m512 e = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, e);
}
#endif

#if defined(__AVX512F__)
/* V accumulation for GG query heads at once, keys outer: each V row is loaded once for all of
 * them (heads outer re-read the block from L2 per head: half the kernel's time at G = 4,
 * Dv = 96), and GG * NV accumulators in registers hide the FMA latency. GG, NV are constants
 * after inlining (GG * NV <= 24: with the GG broadcasts and the row vector, 32 zmm). */
static inline __attribute__((always_inline)) void vacc_heads(
    const float *sc, float *acc, const kv_t *vh, const int64_t *sl, int64_t n, int64_t Dv,
    const int GG, const int NV)
{
    __m512 a[24], p[8];
    for (int i = 0; i < GG; ++i)
        for (int c = 0; c < NV; ++c) a[i * NV + c] = _mm512_loadu_ps(acc + i * Dv + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
        const kv_t *vr = vh + sl[t] * Dv;
        for (int i = 0; i < GG; ++i) p[i] = _mm512_set1_ps(sc[i * BLK + t]);
        for (int c = 0; c < NV; ++c) {
            const __m512 vv = ld16(vr + 16 * c);
            for (int i = 0; i < GG; ++i) a[i * NV + c] = _mm512_fmadd_ps(p[i], vv, a[i * NV + c]);
        }
    }
    for (int i = 0; i < GG; ++i)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + i * Dv + 16 * c, a[i * NV + c]);
}

/* All G heads' V accumulation in groups that fit the registers; 0 if this shape cannot. */
static inline __attribute__((always_inline)) int vacc_all(
    const float *sc, float *acc, const kv_t *vh, const int64_t *sl, int64_t n, int64_t G, int64_t Dv)
{
    if (Dv % 16 || Dv > 16 * 24) return 0;
    const int nv = (int)(Dv / 16);
    int gg = 8;
    while (gg > 1 && (gg * nv > 24 || G % gg)) gg /= 2;
    for (int64_t i0 = 0; i0 < G; i0 += gg) {
        const float *s0 = sc + i0 * BLK;
        float *a0 = acc + i0 * Dv;
        switch (gg) {
        case 8: vacc_heads(s0, a0, vh, sl, n, Dv, 8, nv); break;
        case 4: vacc_heads(s0, a0, vh, sl, n, Dv, 4, nv); break;
        case 2: vacc_heads(s0, a0, vh, sl, n, Dv, 2, nv); break;
        default: vacc_heads(s0, a0, vh, sl, n, Dv, 1, nv); break;
        }
    }
    return 1;
}
#endif

static inline __attribute__((always_inline)) int decode_body(
    const act_t *q,        /* [B, Hq, Dqk] */
    const kv_t *kpool,     /* [Hkv, S, Dqk] */
    const kv_t *vpool,     /* [Hkv, S, Dv] */
    const int64_t *table,  /* [R, ld_slots] slot table */
    const int64_t *trows,  /* [B] its row of each sequence */
    const int64_t *k0,     /* [B] first key's position, or NULL (all 0) */
    const int64_t *lens,   /* [B] */
    const float *sinks,    /* [Hq] or NULL */
    act_t *out,            /* [B, Hq, Dv] */
    int64_t B, int64_t Hq, int64_t Hkv, int64_t Dqk, int64_t Dv, int64_t S, int64_t ld_slots,
    float scale, float softcap, int64_t item_begin, int64_t item_end)
{
    const int64_t G = Hq / Hkv;
    const int64_t widen = ACT_IS_F32 ? 0 : G * Dqk + Dv; /* bf16 activations: the item's queries, an output row */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(G * BLK + G * Dv + 2 * G + widen));
    if (!buf) return -1;
    float *sc = buf;               /* [G, BLK] scores, then probabilities */
    float *acc = sc + G * BLK;     /* [G, Dv] */
    float *mx = acc + G * Dv;      /* [G] running max */
    float *den = mx + G;           /* [G] running sum */
    float *qw = den + G;           /* [G, Dqk] widened queries (bf16 builds) */
    float *orow = qw + G * Dqk;    /* [Dv] an output row before rounding (bf16 builds) */
    (void)qw;
    (void)orow;
    (void)B;
    for (int64_t it = item_begin; it < item_end; ++it) {
        const int64_t b = it / Hkv, h = it % Hkv;
        const int64_t L = lens[b];
        const int64_t *sl = table + trows[b] * ld_slots + (k0 ? k0[b] : 0);
#if ACT_IS_F32
        const float *qh = q + (b * Hq + h * G) * Dqk;
#else
        act_load_row(qw, q + (b * Hq + h * G) * Dqk, G * Dqk);
        const float *qh = qw;
#endif
        const kv_t *kh = kpool + h * S * Dqk;
        const kv_t *vh = vpool + h * S * Dv;
        memset(acc, 0, sizeof(float) * (size_t)(G * Dv));
        for (int64_t i = 0; i < G; ++i) { mx[i] = -1e30f; den[i] = 0.f; }
        for (int64_t j0 = 0; j0 < L; j0 += BLK) {
            const int64_t n = L - j0 < BLK ? L - j0 : BLK;
            /* pages are scattered: fetch the next block's rows while this one computes */
            const int64_t pf = L - j0 - BLK < BLK ? L - j0 - BLK : BLK;
            for (int64_t t = 0; t < pf; ++t) {
                const char *kn = (const char *)(kh + sl[j0 + BLK + t] * Dqk);
                const char *vn = (const char *)(vh + sl[j0 + BLK + t] * Dv);
                for (int64_t o = 0; o < Dqk * (int64_t)sizeof(kv_t); o += 64) __builtin_prefetch(kn + o);
                for (int64_t o = 0; o < Dv * (int64_t)sizeof(kv_t); o += 64) __builtin_prefetch(vn + o);
            }
            int64_t t = 0;
#if defined(__AVX512F__)
            if (Dqk % 16 == 0) {
                for (; t + 16 <= n; t += 16) {
                    const kv_t *kr[16];
                    for (int u = 0; u < 16; ++u) kr[u] = kh + sl[j0 + t + u] * Dqk;
                    for (int64_t i = 0; i < G; ++i) {
                        const float *qi = qh + i * Dqk;
                        __m512 a[16];
                        for (int u = 0; u < 16; ++u) a[u] = _mm512_setzero_ps();
                        for (int64_t d = 0; d < Dqk; d += 16) {
                            const __m512 qv = _mm512_loadu_ps(qi + d);
                            for (int u = 0; u < 16; ++u) a[u] = _mm512_fmadd_ps(qv, ld16(kr[u] + d), a[u]);
                        }
                        _mm512_storeu_ps(sc + i * BLK + t, _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale)));
                    }
                }
            }
#endif
#if defined(__AVX2__) && defined(__FMA__)
            if (Dqk % 8 == 0) {
                for (; t + 8 <= n; t += 8) {
                    const kv_t *kr[8];
                    for (int u = 0; u < 8; ++u) kr[u] = kh + sl[j0 + t + u] * Dqk;
                    for (int64_t i = 0; i < G; ++i) {
                        const float *qi = qh + i * Dqk;
                        __m256 a[8];
                        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
                        for (int64_t d = 0; d < Dqk; d += 8) {
                            const __m256 qv = _mm256_loadu_ps(qi + d);
                            for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, ld8(kr[u] + d), a[u]);
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
            }
#endif
            for (; t < n; ++t) {
                const kv_t *kr = kh + sl[j0 + t] * Dqk;
                for (int64_t i = 0; i < G; ++i) {
                    const float *qi = qh + i * Dqk;
                    float s = 0.f;
                    for (int64_t d = 0; d < Dqk; ++d) s += qi[d] * kv_f(kr[d]);
                    sc[i * BLK + t] = s * scale;
                }
            }
            if (softcap > 0.f)
                for (int64_t i = 0; i < G; ++i)
                    for (int64_t u = 0; u < n; ++u) sc[i * BLK + u] = softcap * tanhf(sc[i * BLK + u] / softcap);
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
#if defined(__AVX512F__)
            if (vacc_all(sc, acc, vh, sl + j0, n, G, Dv)) continue;
#endif
            /* shapes vacc_all cannot take (Dv not a multiple of 16, or above 384) and AVX2: heads
             * outer, keys inner, so the accumulator stays in registers (keys outer kept it in
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
                        const kv_t *vr = vh + sl[j0 + t] * Dv + d0;
                        const __m256 pv = _mm256_set1_ps(si[t]);
                        for (int c = 0; c < nv; ++c) a[c] = _mm256_fmadd_ps(pv, ld8(vr + 8 * c), a[c]);
                    }
                    for (int c = 0; c < nv; ++c) _mm256_storeu_ps(ai + d0 + 8 * c, a[c]);
                    if (nv < 8) { d0 += 8 * nv; break; }
                }
#endif
                for (int64_t t = 0; t < n && d0 < Dv; ++t) {
                    const kv_t *vr = vh + sl[j0 + t] * Dv;
                    const float p = si[t];
                    for (int64_t d = d0; d < Dv; ++d) ai[d] += p * kv_f(vr[d]);
                }
            }
        }
        for (int64_t i = 0; i < G; ++i) {
            float d0 = den[i];
            if (sinks && L > 0) d0 += expf(sinks[h * G + i] - mx[i]);
            const float inv = d0 > 0.f ? 1.f / d0 : 0.f;
            act_t *o = out + (b * Hq + h * G + i) * Dv;
            const float *ai = acc + i * Dv;
#if ACT_IS_F32
            for (int64_t d = 0; d < Dv; ++d) o[d] = ai[d] * inv;
#else
            for (int64_t d = 0; d < Dv; ++d) orow[d] = ai[d] * inv;
            act_store_row(o, orow, Dv);
#endif
        }
    }
    free(buf);
    return 0;
}

#define SPEC(DQ, DV) \
    static int decode_##DQ##_##DV(const act_t *q, const kv_t *k, const kv_t *v, const int64_t *tb, \
                                  const int64_t *tr, const int64_t *k0, const int64_t *lens, const float *sinks, act_t *out, int64_t B, int64_t Hq, \
                                  int64_t Hkv, int64_t S, int64_t ld, float scale, float cap, int64_t a, int64_t e) \
    { return decode_body(q, k, v, tb, tr, k0, lens, sinks, out, B, Hq, Hkv, DQ, DV, S, ld, scale, cap, a, e); }
SPEC(16, 16) SPEC(24, 16) SPEC(32, 32) SPEC(48, 48) SPEC(64, 64) SPEC(80, 80) SPEC(96, 96)
SPEC(128, 128) SPEC(192, 128) SPEC(256, 256)

/* Head sizes known at compile time unroll and vectorize the dot products (measured ~2x at 24);
 * other sizes take the generic body. */
int mmserve_paged_decode_f32(
    const act_t *q, const kv_t *kpool, const kv_t *vpool, const int64_t *table, const int64_t *trows,
    const int64_t *k0, const int64_t *lens, const float *sinks, act_t *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t Dqk, int64_t Dv, int64_t S,
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

/* The same work split into ``chunks`` ranges of items run on another library's thread pool:
 * ``par_for`` is its ``mmserve_par_for(fn, ctx, n, threads)`` (llm_svc/models/cpu_gemv.c), whose
 * caller works too and waits only for chunks a helper started. Returns 0, or -1 when a chunk
 * could not get its scratch memory. */
typedef void (*chunk_fn_t)(void *ctx, int64_t i);
typedef void (*par_for_t)(chunk_fn_t fn, void *ctx, int64_t n, int64_t threads);
typedef struct {
    const act_t *q;
    const kv_t *kpool, *vpool;
    const int64_t *table, *trows, *k0, *lens;
    const float *sinks;
    act_t *out;
    int64_t B, Hq, Hkv, Dqk, Dv, S, ld_slots, items, chunks;
    float scale, softcap;
    volatile int failed;
} decode_job_t;

static void decode_chunk(void *ctx, int64_t i)
{
    decode_job_t *j = (decode_job_t *)ctx;
    const int64_t a = j->items * i / j->chunks, e = j->items * (i + 1) / j->chunks;
    if (mmserve_paged_decode_f32(j->q, j->kpool, j->vpool, j->table, j->trows, j->k0, j->lens, j->sinks, j->out, j->B,
                                 j->Hq, j->Hkv, j->Dqk, j->Dv, j->S, j->ld_slots, j->scale, j->softcap, a, e) != 0)
        j->failed = 1;
}

int mmserve_paged_decode_pooled_f32(
    const act_t *q, const kv_t *kpool, const kv_t *vpool, const int64_t *table, const int64_t *trows,
    const int64_t *k0, const int64_t *lens, const float *sinks, act_t *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t Dqk,
    int64_t Dv, int64_t S, int64_t ld_slots, float scale, float softcap, void *par_for, int64_t threads, int64_t chunks)
{
    decode_job_t job = {q, kpool, vpool, table, trows, k0, lens, sinks, out, B, Hq, Hkv, Dqk, Dv, S, ld_slots,
                        B * Hkv, chunks < 1 ? 1 : chunks, scale, softcap, 0};
    if (job.chunks > job.items) job.chunks = job.items;
    ((par_for_t)par_for)(decode_chunk, &job, job.chunks, threads);
    return job.failed ? -1 : 0;
}

/* One row of n activations into a pool row: a copy where both have one type, else widened to
 * float32 and rounded to the pool's type (round to nearest even, as torch's copy_). */
static inline void kv_put_row(kv_t *dst, const act_t *src, int64_t n)
{
#if (ACT_IS_F32 && !defined(KV_BF16) && !defined(KV_F16)) || (!ACT_IS_F32 && defined(KV_BF16))
    memcpy(dst, src, (size_t)n * sizeof(kv_t));
#else
    float tmp[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        const int64_t m = n - i0 < 256 ? n - i0 : 256;
        act_load_row(tmp, src + i0, m);
#if defined(KV_BF16)
        bf16_store_row(dst + i0, tmp, m);
#else
        for (int64_t i = 0; i < m; ++i) dst[i0 + i] = (kv_t)tmp[i];
#endif
    }
#endif
}

/* A step's new K / V rows into the pools at their slots, one row per (token, kv head):
 * kpool [Hkv, S, Dqk] <- k [T, Hkv, Dqk] (token stride ldk, heads contiguous inside a token),
 * vpool [Hkv, S, Dv] <- v likewise; rows of the build's activation type into pools of its KV
 * type. torch's index_copy_ over a transposed view was an OpenMP
 * region per layer (~0.3 ms at 320 tokens once its team slept, far more beside a busy core).
 * Returns 0, or 1 if a slot is outside [0, S) (nothing written). */
int mmserve_paged_write_f32(kv_t *kpool, kv_t *vpool, int64_t S, int64_t Hkv, int64_t Dqk, int64_t Dv,
                            const int64_t *slots, int64_t T, const act_t *k, int64_t ldk, const act_t *v, int64_t ldv)
{
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= S) return 1;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        for (int64_t h = 0; h < Hkv; ++h) {
            kv_put_row(kpool + (h * S + s) * Dqk, k + t * ldk + h * Dqk, Dqk);
            kv_put_row(vpool + (h * S + s) * Dv, v + t * ldv + h * Dv, Dv);
        }
    }
    return 0;
}
