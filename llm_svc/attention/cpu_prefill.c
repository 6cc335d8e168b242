/* Paged prefill attention on the CPU: a chunk's queries over their causal (optionally sliding)
 * context, K/V read in place from the pool, flash-style (online softmax, no score matrix).
 *
 * Pools are head-major, as llm_svc.attention.base.LayerKV holds them:
 *   k [Hkv, S, Dqk], v [Hkv, S, Dv]  (float32, contiguous)
 * Member b of a bucket has ns[b] queries q[b, 0 .. ns[b] - 1] at positions qpos0[b] + i; query
 * at position p reads the keys at positions max(k0[b], p - W + 1) .. p (W = 0: from k0[b]),
 * slot-table row trows[b] mapping positions to pool slots. Padded query rows (i >= ns[b]) are
 * written as zeros.
 *
 * Work item = (member b, query block, kv head h): M tile rows = MQ queries x the G query heads
 * of h (GQA: each K / V row is read once for all of them). Everything is vectorised over those
 * M rows: Q^T [D][M] is packed (and pre-scaled by scale * log2 e) once per item, scores are
 * S^T [NK][M] (a K row broadcast against Q^T), the softmax state is one value per row, the
 * output O^T [Dv][M] accumulates V^T P^T (a V element broadcast against a P^T row). Causal
 * blocks past an item's last query are never visited; only the blocks that straddle the
 * diagonal or the window's edge are masked. Sinks (MiMo) start the softmax: max sink[h], mass 1.
 * exp2 is a degree-7 polynomial (relative error ~1e-7), exactly 0 below 2^-126.
 *
 * GCC vector extensions, VW floats wide: 8 on AVX2 and Zen 4 (it runs 256-bit FMAs at its full
 * rate), 16 on other AVX-512 CPUs, with register tiles sized for 16 or 32 vector registers.
 * Measured (2-core AVX2 EPYC, 2 threads, 8 / 2 heads of 96): 2,048 queries over themselves
 * 130 GFLOP/s, over 4,000 more keys 128 (torch's flash kernel 131-137, the matmul peak ~140).
 * No OpenMP (torch brings its own runtime): the caller runs items begin, begin + step, ...
 */
#include <stdint.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>

/* The pools' element type, one build each: each element widened to float32 as it is broadcast */
#include "kv_elem.h"
/* The activations' (queries, output): float32, or bfloat16 with -DACT_BF16 (widened as Q^T is
 * packed, each output row rounded as it is stored) */
#include "act_elem.h"

/* Vector width in floats (-DVW=.. builds another): 16 where the CPU has AVX-512 on full-width
 * units (Intel: two 512-bit FMAs a cycle, so 8-wide code reaches half the peak), 8 on AVX2 and on
 * Zen 4 (it splits a 512-bit FMA in two: the 8-wide tiling below was measured best there). */
#ifndef VW
#if defined(__AVX512F__) && !defined(__znver4__)
#define VW 16
#else
#define VW 8
#endif
#endif
#define VL VW
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));

#ifndef MV /* -DMV=.. -DJR=.. -DDR=.. build another tiling (the tests check each against the reference) */
#if VL == 16
/* 64 rows (4 vectors) x 6 keys / 6 value columns: 24 accumulators of 32 registers. 2-core Xeon
 * (AVX-512, AMX), 2 threads, 6,000-token prefill in the engine, full layers: vs_vllm MiMo
 * (Dv 96) 211 GFLOP/s at 8 wide -> 287 at 4 x 3 -> 312 at 4 x 6; Gemma 3 (Dv 64) 199 -> 286 */
#define MV 4
#define JR 6
#define DR 6
#elif defined(__AVX512F__)
/* 64 rows x 3 keys / 3 value columns. 32 rows x 6 (24 accumulators) was 10-13% faster per call on
 * a pool that stays in L3 (2 threads, 4,096 queries of a MiMo full layer 158 -> 142 ms) but slower
 * in the engine (a 6,000-token MiMo prefill's kernel time 731 -> 780 ms): half the queries per
 * item read the context twice as often */
#define MV 8 /* vectors per tile row set: M = 64 rows */
#define JR 3 /* keys per score micro-tile: JR x MV accumulators */
#define DR 3 /* V columns per output micro-tile */
#else
/* 16 registers: one row of 8 accumulators; M = 64 rows beat 32 (JR = DR = 2) by 5-7% on full
 * layers (2-core AVX2 EPYC, 2 threads, 2,048 queries: 123 -> 130 GFLOP/s) */
#define MV 8
#define JR 1
#define DR 1
#endif
#endif
#define M (MV * VL)

/* rows of a tile: a kv head's query heads (G) must fit in one */
int64_t mmserve_prefill_tile_rows(void) { return M; }

#ifndef NK /* keys per softmax block: S^T [NK][M] stays in L1; a multiple of JR, so no block has a tail */
#define NK (VL == 16 ? JR * (64 / JR) : 64) /* 8 wide: 64, as measured on Zen 4 */
#endif
/* "minus infinity", finite (fast-math assumes no infinities): a row's running max starts at
 * INIT, masked scores are MASKED, so a masked score's exp2 is 0 even while its row has seen no
 * real key yet */
#define INIT (-1.0e30f)
#define MASKED (-3.0e38f)

static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vmax(vf a, vf b)
{
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* 2^x for x <= 0 (degree-7 Taylor of 2^f on f in [-0.5, 0.5]); 0 below -126. */
static inline vf vexp2(vf x)
{
    const vi small = x < vsplat(-126.0f);
    x = vmax(x, vsplat(-126.0f));
    const vf t = x + vsplat(128.5f); /* > 0: truncation is floor */
    const vi ni = __builtin_convertvector(t, vi);
    const vf f = x - (__builtin_convertvector(ni, vf) - vsplat(128.0f)); /* in [-0.5, 0.5) */
    vf p = vsplat(1.5252733804059840e-5f);
    p = p * f + vsplat(1.5403530393381609e-4f);
    p = p * f + vsplat(1.3333558146428443e-3f);
    p = p * f + vsplat(9.6181291076284772e-3f);
    p = p * f + vsplat(5.5504108664821580e-2f);
    p = p * f + vsplat(2.4022650695910071e-1f);
    p = p * f + vsplat(6.9314718055994531e-1f);
    p = p * f + vsplat(1.0f);
    const vi bits = (ni - 1) << 23; /* 2^(ni - 128) as a float's exponent field: (ni - 128 + 127) << 23 */
    const vf r = p * (vf)bits;
    return (vf)((vi)r & ~small);
}

/* S^T[j][:] = sum_d K_j[d] * QT[d][:] for j < nk (K rows through kp). */
static inline void scores(float *restrict st, const float *restrict qt, const kv_t *const *kp, int64_t nk, int64_t D)
{
    int64_t j = 0;
    for (; j + JR <= nk; j += JR) {
        vf acc[JR][MV];
        for (int r = 0; r < JR; ++r)
            for (int c = 0; c < MV; ++c) acc[r][c] = vsplat(0.0f);
        const kv_t *k[JR];
        for (int r = 0; r < JR; ++r) k[r] = kp[j + r];
        for (int64_t d = 0; d < D; ++d) {
            const vf *qr = (const vf *)(qt + d * M);
            vf b[JR];
            for (int r = 0; r < JR; ++r) b[r] = vsplat(kv_f(k[r][d]));
            for (int c = 0; c < MV; ++c) {
                const vf qv = qr[c];
                for (int r = 0; r < JR; ++r) acc[r][c] += b[r] * qv;
            }
        }
        for (int r = 0; r < JR; ++r)
            for (int c = 0; c < MV; ++c) ((vf *)(st + (j + r) * M))[c] = acc[r][c];
    }
    for (; j < nk; ++j) {
        vf acc[MV];
        for (int c = 0; c < MV; ++c) acc[c] = vsplat(0.0f);
        const kv_t *k = kp[j];
        for (int64_t d = 0; d < D; ++d) {
            const vf *qr = (const vf *)(qt + d * M);
            const vf b = vsplat(kv_f(k[d]));
            for (int c = 0; c < MV; ++c) acc[c] += b * qr[c];
        }
        for (int c = 0; c < MV; ++c) ((vf *)(st + j * M))[c] = acc[c];
    }
}

/* O^T[e .. e + R - 1][:] += sum_j V_j[e ..] * P^T[j][:], R value columns in registers (R a
 * constant after inlining). */
static inline __attribute__((always_inline)) void values_block(
    float *restrict ot, const float *restrict pt, const kv_t *const *vp, int64_t nk, int64_t e, const int R)
{
    vf acc[DR][MV];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < MV; ++c) acc[r][c] = ((const vf *)(ot + (e + r) * M))[c];
    for (int64_t j = 0; j < nk; ++j) {
        const vf *pr = (const vf *)(pt + j * M);
        const kv_t *v = vp[j] + e;
        vf b[DR];
        for (int r = 0; r < R; ++r) b[r] = vsplat(kv_f(v[r]));
        for (int c = 0; c < MV; ++c) {
            const vf pv = pr[c];
            for (int r = 0; r < R; ++r) acc[r][c] += b[r] * pv;
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < MV; ++c) ((vf *)(ot + (e + r) * M))[c] = acc[r][c];
}

/* O^T[e][:] += sum_j V_j[e] * P^T[j][:] for e < Dv, j < nk (V rows through vp): blocks of DR
 * columns, then of 4 (a head of 64 under DR = 6: 10 x 6 + 4), then single columns. */
static inline void values(float *restrict ot, const float *restrict pt, const kv_t *const *vp, int64_t nk, int64_t Dv)
{
    int64_t e = 0;
    for (; e + DR <= Dv; e += DR) values_block(ot, pt, vp, nk, e, DR);
#if DR > 4
    for (; e + 4 <= Dv; e += 4) values_block(ot, pt, vp, nk, e, 4);
#endif
    for (; e < Dv; ++e) values_block(ot, pt, vp, nk, e, 1);
}

/* Items: (member b, query block qb, kv head h), in that nesting; every ``step``-th from ``begin``.
 * Returns 0, or 1 when scratch memory could not be had. */
int mmserve_paged_prefill_f32(
    const act_t *q,          /* [B, NQ, Hq, D] */
    const kv_t *kpool,       /* [Hkv, S, D] */
    const kv_t *vpool,       /* [Hkv, S, Dv] */
    const int64_t *table,    /* [R, cap] */
    const int64_t *trows,    /* [B] */
    const int64_t *k0,       /* [B] first readable key position */
    const int64_t *qpos0,    /* [B] position of query 0 */
    const int64_t *ns,       /* [B] real queries */
    const float *sinks,      /* [Hq] or NULL */
    act_t *out,              /* [B, NQ, Hq, Dv] */
    int64_t B, int64_t NQ, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t S, int64_t cap,
    int64_t window, float scale, int64_t begin, int64_t step)
{
    const int64_t G = Hq / Hkv;
    const int64_t MQ = G <= M ? M / G : 1; /* queries per item */
    const int64_t rows = MQ * G < M ? MQ * G : M;
    const float L2E = 1.4426950408889634f;
    const size_t need = (size_t)(D * M + NK * M + Dv * M + 2 * M + Dv) * sizeof(float);
    float *scratch = aligned_alloc(64, (need + 63) / 64 * 64);
    const kv_t **ptrs = malloc(sizeof(kv_t *) * 2 * NK);
    if (!scratch || !ptrs || G > M) {
        free(scratch);
        free(ptrs);
        return 1;
    }
    float *qt = scratch, *st = qt + D * M, *ot = st + NK * M, *mrow = ot + Dv * M, *lrow = mrow + M;
    float *orow = lrow + M; /* [Dv] an output row before it is stored */
    const kv_t **kp = ptrs, **vp = ptrs + NK;
    int64_t item = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t nblk = (ns[b] + MQ - 1) / MQ;
        for (int64_t qb = 0; qb < nblk; ++qb) {
            for (int64_t h = 0; h < Hkv; ++h, ++item) {
                if (item < begin || (item - begin) % step) continue;
                const int64_t i0 = qb * MQ, nq = ns[b] - i0 < MQ ? ns[b] - i0 : MQ;
                const int64_t p_first = qpos0[b] + i0, p_last = p_first + nq - 1;
                int64_t qpos[M];
                /* Q^T, scaled; padded rows repeat the last query (finite softmax, never stored) */
                for (int64_t r = 0; r < M; ++r) {
                    const int64_t i = r < rows ? (r / G < nq ? r / G : nq - 1) : nq - 1;
                    const int64_t g = r < rows ? r % G : G - 1;
                    const act_t *src = q + ((b * NQ + i0 + i) * Hq + h * G + g) * D;
                    for (int64_t d = 0; d < D; ++d) qt[d * M + r] = act_f(src[d]) * scale * L2E;
                    qpos[r] = p_first + i;
                    mrow[r] = sinks ? sinks[h * G + g] * L2E : INIT;
                    lrow[r] = sinks ? 1.0f : 0.0f;
                }
                memset(ot, 0, sizeof(float) * Dv * M);
                int64_t klo = k0[b];
                if (window > 0 && p_first - window + 1 > klo) klo = p_first - window + 1;
                const int64_t *trow = table + trows[b] * cap;
                const kv_t *kh = kpool + h * S * D, *vh = vpool + h * S * Dv;
                for (int64_t kb = klo; kb <= p_last; kb += NK) {
                    const int64_t nk = p_last - kb + 1 < NK ? p_last - kb + 1 : NK;
                    for (int64_t j = 0; j < nk; ++j) {
                        const int64_t slot = trow[kb + j];
                        kp[j] = kh + slot * D;
                        vp[j] = vh + slot * Dv;
                    }
                    scores(st, qt, kp, nk, D);
                    /* mask keys past a row's position (the diagonal) or before its window */
                    const int diag = kb + nk - 1 > p_first;
                    const int edge = window > 0 && kb <= p_last - window;
                    if (diag || edge) {
                        /* positions relative to kb fit int32 (a block's keys and its rows' positions
                         * are within one window or chunk of each other) */
                        vi qrel[MV];
                        for (int c = 0; c < MV; ++c)
                            for (int l = 0; l < VL; ++l) qrel[c][l] = (int32_t)(qpos[c * VL + l] - kb);
                        const vi masked = (vi)vsplat(MASKED);
                        const int32_t w = window > 0 ? (int32_t)window : INT32_MAX / 2;
                        for (int64_t j = 0; j < nk; ++j) {
                            const vi kj = (vi){0} + (int32_t)j;
                            for (int c = 0; c < MV; ++c) {
                                const vi out = (kj > qrel[c]) | (kj <= qrel[c] - w); /* -1 where masked */
                                vi *sv = (vi *)(st + j * M) + c;
                                *sv = (*sv & ~out) | (masked & out);
                            }
                        }
                    }
                    vf mnew[MV], alpha[MV], lsum[MV];
                    for (int c = 0; c < MV; ++c) mnew[c] = ((const vf *)mrow)[c];
                    for (int64_t j = 0; j < nk; ++j)
                        for (int c = 0; c < MV; ++c) mnew[c] = vmax(mnew[c], ((const vf *)(st + j * M))[c]);
                    for (int c = 0; c < MV; ++c) {
                        alpha[c] = vexp2(((const vf *)mrow)[c] - mnew[c]);
                        lsum[c] = vsplat(0.0f);
                    }
                    for (int64_t j = 0; j < nk; ++j)
                        for (int c = 0; c < MV; ++c) {
                            vf *s = (vf *)(st + j * M) + c;
                            const vf p = vexp2(*s - mnew[c]);
                            *s = p;
                            lsum[c] += p;
                        }
                    for (int c = 0; c < MV; ++c) {
                        ((vf *)lrow)[c] = ((const vf *)lrow)[c] * alpha[c] + lsum[c];
                        ((vf *)mrow)[c] = mnew[c];
                    }
                    for (int64_t e = 0; e < Dv; ++e)
                        for (int c = 0; c < MV; ++c) ((vf *)(ot + e * M))[c] *= alpha[c];
                    values(ot, st, vp, nk, Dv);
                }
                for (int64_t r = 0; r < rows; ++r) {
                    const int64_t i = r / G, g = r % G;
                    if (i >= nq) break;
                    act_t *dst = out + ((b * NQ + i0 + i) * Hq + h * G + g) * Dv;
                    const float inv = 1.0f / lrow[r];
                    for (int64_t e = 0; e < Dv; ++e) orow[e] = ot[e * M + r] * inv;
                    act_store_row(dst, orow, Dv);
                }
            }
        }
    }
    free(scratch);
    free(ptrs);
    return 0;
}

/* The same items run on another library's thread pool: ``par_for`` is its
 * ``mmserve_par_for(fn, ctx, n, threads)`` (llm_svc/models/cpu_gemv.c), each of its chunks one
 * item (the caller takes them from the front, helpers from the back: a causal chunk's cheap
 * items and its dear ones). Returns 0, or 1 when a chunk could not get its scratch memory. */
typedef void (*chunk_fn_t)(void *ctx, int64_t i);
typedef void (*par_for_t)(chunk_fn_t fn, void *ctx, int64_t n, int64_t threads);
typedef struct {
    const act_t *q;
    const kv_t *kpool, *vpool;
    const int64_t *table, *trows, *k0, *qpos0, *ns;
    const float *sinks;
    act_t *out;
    int64_t B, NQ, Hq, Hkv, D, Dv, S, cap, window, items;
    float scale;
    volatile int failed;
} prefill_job_t;

static void prefill_chunk(void *ctx, int64_t i)
{
    prefill_job_t *j = (prefill_job_t *)ctx;
    if (mmserve_paged_prefill_f32(j->q, j->kpool, j->vpool, j->table, j->trows, j->k0, j->qpos0, j->ns, j->sinks, j->out,
                                  j->B, j->NQ, j->Hq, j->Hkv, j->D, j->Dv, j->S, j->cap, j->window, j->scale, i,
                                  j->items) != 0)
        j->failed = 1;
}

int mmserve_paged_prefill_pooled_f32(
    const act_t *q, const kv_t *kpool, const kv_t *vpool, const int64_t *table, const int64_t *trows, const int64_t *k0,
    const int64_t *qpos0, const int64_t *ns, const float *sinks, act_t *out, int64_t B, int64_t NQ, int64_t Hq, int64_t Hkv,
    int64_t D, int64_t Dv, int64_t S, int64_t cap, int64_t window, float scale, void *par_for, int64_t threads)
{
    const int64_t G = Hq / Hkv;
    const int64_t MQ = G <= M ? M / G : 1;
    int64_t items = 0;
    for (int64_t b = 0; b < B; ++b) items += (ns[b] + MQ - 1) / MQ * Hkv;
    prefill_job_t job = {q, kpool, vpool, table, trows, k0, qpos0, ns, sinks, out, B, NQ, Hq, Hkv, D, Dv, S, cap, window,
                         items, scale, 0};
    if (items > 0) ((par_for_t)par_for)(prefill_chunk, &job, items, threads);
    return job.failed;
}
