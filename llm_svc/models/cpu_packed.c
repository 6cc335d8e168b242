/* GEMMs on packed weights for the CPU: plain linears, and the routed experts of a MoE layer in
 * one call. Micro-tiles are broadcast-form (one scalar of x times a row of the packed weight per
 * FMA, no horizontal sums): MR rows x 2 VL columns of accumulators, the weight packed K-major in
 * blocks of 2 VL columns so a tile streams it contiguously. AVX-512: VL 16, MR 12 (24
 * accumulators: each weight row loaded serves 12 rows, and the weight panel's stream from L2 is
 * what bound 8 rows on a 2-core Xeon: linears 340-360 -> 352-376 GFLOP/s on 2 threads, one MiMo
 * MoE layer at 1,300 tokens 258 -> 379); otherwise VL 8, MR 6 (12). Work items run on the few-row kernel's elastic pool
 * (cpu_gemv.c's par_for, passed in), whose caller never waits at a barrier for a thread whose
 * core another process took; every output element is written by one item in a fixed order, so
 * results do not depend on the thread count.
 *
 * Linears: out [M, N] = x . w^T + bias, w packed [ceil(N / 2VL)][K][2 VL]; an item is 12 MR rows x
 * 2 VL columns. Any row count runs at its own size (oneDNN's primitives are built per shape, so
 * rows were padded to buckets, ~6% more work and a copy).
 *
 * Routed experts: out[t] = sum over k of w[t, k] * down[e] . (silu(gate[e] . x[t]) * (up[e] . x[t])),
 * e = idx[t, k]. The (token, expert) pairs are sorted by expert once (token order inside); the
 * GEMMs read the tokens' rows of x in place through row pointers (no gather copy) and sum each
 * token's pairs straight into out (no per-pair output, no index_add), in two passes over the pool:
 *   1. h [P, I] = silu(x_rows . gate^T) * (x_rows . up^T): an item is one column block of VL of
 *      I for every expert; its micro-tile is MR rows x (VL gate + VL up) columns, the activation
 *      applied to the accumulators before they are stored.
 *   2. out [T, H] = sum of w * (h . down^T): an item is one column block of 2 VL of H for every
 *      expert, in ascending expert order; each row's result scaled by its routing weight and
 *      added to its token's row of out.
 *   Calls with many pairs (prefill chunks: at least MR pairs per expert on average) run row-group passes
 *   instead (MOE_RB, below): an item is up to 12 MR pairs of one expert for every column block,
 *   each pair's down product stored, then each token's pairs summed in ascending expert order
 *   (the same sums, bit for bit, as the column-block passes).
 *   gp [E][I / VL][H][2 VL]: for column block j and input k, VL gate then VL up weights;
 *   dp [E][H / 2VL][I][2 VL].
 * The per-expert oneDNN GEMMs of ~80 rows this replaces ran at ~100-140 GFLOP/s on 2 threads where
 * big GEMMs reach ~200. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#ifndef MR
#define MR 12
#endif
#else
#define VL 8
#define MR 6
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
#define NB (2 * VL) /* columns of a packed tile */
#include "w_elem.h" /* the weight format of this build: float32, bfloat16, FP8 or MXFP4 */

/* below this many multiply-adds a call runs on the caller alone: a helper's hand-off costs more
 * than it saves (a tiny model's [16, 64] x [64, 96] linears; real ones are 10-100x above it) */
#define MIN_PAR_MACS (1 << 18)

typedef void (*chunk_fn_t)(void* ctx, int64_t i);
typedef void (*par_for_t)(chunk_fn_t fn, void* ctx, int64_t n, int64_t threads);

static inline vf vload(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* e^-v kept finite (-ffast-math assumes no infinities): 1 / (1 + e^80) is 0 in float */
static inline float exp_neg(float v) { return expf(fminf(-v, 80.f)); }

int64_t mmserve_packed_vl(void) { return VL; }

/* this build's weight format (w_elem.h: 0 float32, 1 bfloat16, 2 FP8 e4m3, 3 MXFP4) */
int64_t mmserve_packed_format(void) { return W_FORMAT; }

/* gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I] -> gp, dp (layouts above; each
 * E * 2I * H and E * H * I floats). Returns 1 if I is not a multiple of VL or H of 2 VL. */
#if W_FORMAT == 0
int mmserve_moe_pack_f32(const float* gate_up, const float* down, int64_t E, int64_t H, int64_t I, float* gp,
                         float* dp) {
    if (I % VL || H % (2 * VL)) return 1;
    for (int64_t e = 0; e < E; e++) {
        const float* g = gate_up + e * 2 * I * H;
        const float* u = g + I * H;
        float* o = gp + e * 2 * I * H;
        for (int64_t j = 0; j < I / VL; j++)
            for (int64_t k = 0; k < H; k++)
                for (int64_t c = 0; c < VL; c++) {
                    o[(j * H + k) * 2 * VL + c] = g[(j * VL + c) * H + k];
                    o[(j * H + k) * 2 * VL + VL + c] = u[(j * VL + c) * H + k];
                }
        const float* d = down + e * H * I;
        float* q = dp + e * H * I;
        for (int64_t j = 0; j < H / (2 * VL); j++)
            for (int64_t k = 0; k < I; k++)
                for (int64_t c = 0; c < 2 * VL; c++) q[(j * I + k) * 2 * VL + c] = d[(j * 2 * VL + c) * I + k];
    }
    return 0;
}
#endif

/* Software prefetch W_PREFETCH bytes ahead of the row being read (0: none). A tile is one
 * stream of K x W_ROW bytes (an FP8 expert's gate | up tile at H = 4096: 128 KB), and a MoE
 * decode step jumps to another expert's tile after each: the hardware prefetcher alone kept too
 * few lines in flight. 32 FP8 experts of MiMo-V2-Flash size, 2 threads: 16 tokens 100 -> 51 ms,
 * one token 20.5 -> 9.7 ms (2 KB ahead: 55 / 11.1, 8 KB: 55 / 10.9, one line a row). Prefetches past a tile's
 * end touch the next tile or fall outside the weight: a prefetch never faults. */
#ifndef W_PREFETCH
#define W_PREFETCH 4096 /* float32 experts too: 24 of that size, 16 tokens 130 -> 123 ms, one 32.3 -> 30.7 */
#endif
/* one prefetch a row, the same code in every build: the tile loops then compile alike, and a
 * format's results equal float32's on the same (widened) weights bit for bit, which
 * -ffast-math's freedom to reassociate would not promise for differently shaped loops (float32
 * rows of 128 bytes get every other line prefetched: the hardware prefetcher follows) */
#define W_PREFETCH_ROW(p) __builtin_prefetch((p) + W_PREFETCH)

/* acc0[m] += a[m][k] * b[k][0:VL], acc1[m] += a[m][k] * b[k][VL:2VL] for k < K and the MM rows
 * a[0..MM) (row pointers); b one tile [K][W_ROW bytes] of this build's format, sc its scales
 * [W_GROUPS(K)][NB] (w_elem.h), each row widened to float32 in registers. MM is a compile-time
 * count at each call site. */
static inline __attribute__((always_inline)) void tile(const float* const* a, const uint8_t* b, const wscale_t* sc,
                                                       int64_t K, int MM, vf acc0[MR], vf acc1[MR]) {
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = (vf){0};
#if W_GROUP
    for (int64_t k0 = 0; k0 < K; k0 += W_GROUP) {
        vf s0, s1;
        w_scales(sc + (k0 / W_GROUP) * NB, &s0, &s1);
        const int64_t k1 = k0 + W_GROUP < K ? k0 + W_GROUP : K;
        for (int64_t k = k0; k < k1; k++) {
            vf b0, b1;
#if W_PREFETCH
            W_PREFETCH_ROW(b + k * W_ROW);
#endif
            w_row(b + k * W_ROW, s0, s1, &b0, &b1);
            for (int m = 0; m < MM; m++) {
                const float s = a[m][k];
                acc0[m] += s * b0;
                acc1[m] += s * b1;
            }
        }
    }
#else
    (void)sc;
    const vf z = {0};
    for (int64_t k = 0; k < K; k++) {
        vf b0, b1;
#if W_PREFETCH
        W_PREFETCH_ROW(b + k * W_ROW);
#endif
        w_row(b + k * W_ROW, z, z, &b0, &b1);
        for (int m = 0; m < MM; m++) {
            const float s = a[m][k];
            acc0[m] += s * b0;
            acc1[m] += s * b1;
        }
    }
#endif
}

/* The same micro-tile on a tile already widened to float32 ([K][NB] floats, w_widen below):
 * the FMAs in the same order as tile()'s, so the results are the same bit for bit. */
static inline __attribute__((always_inline)) void tile_f(const float* const* a, const float* b, int64_t K, int MM,
                                                         vf acc0[MR], vf acc1[MR]) {
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const vf b0 = vload(b + k * NB), b1 = vload(b + k * NB + VL);
        for (int m = 0; m < MM; m++) {
            const float s = a[m][k];
            acc0[m] += s * b0;
            acc1[m] += s * b1;
        }
    }
}

/* *buf grown to n floats (64-byte aligned) and kept for the next call, *cap its size; NULL when
 * memory is short (the caller then takes its path without scratch) */
static inline float* kept_scratch(float** buf, int64_t* cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
        *cap = *buf ? n : 0;
    }
    return *buf;
}

#if W_FORMAT != 0
/* A narrow tile read by more than MR rows (a prefill's GEMM: up to 12 row blocks an item) is
 * widened once into a per-thread float32 copy ([K][NB], in L1 / L2 beside the rows) and every row
 * block reads that: widening each row of the tile once per row block (a zero-extension and a
 * shift per 8 lanes on AVX2, beside 2 MR FMAs) made bfloat16 prefill GEMMs slower than float32's.
 * The first row block widens it as it goes (tile_keep), the others read the float32 copy. */
static __thread float* wbuf;
static __thread int64_t wcap;

/* the calling thread's tile scratch of n floats (grown, kept), or NULL when memory is short */
static float* tile_scratch(int64_t n) { return kept_scratch(&wbuf, &wcap, n); }

/* tile() that also keeps each widened row in dst [K][NB] (the weights w_row gives, scales
 * applied): the first row block of an item widens the tile while its FMAs run, the others read
 * dst (tile_f). The FMAs are tile()'s, in its order. */
static inline __attribute__((always_inline)) void tile_keep(const float* const* a, const uint8_t* b,
                                                            const wscale_t* sc, int64_t K, int MM, vf acc0[MR],
                                                            vf acc1[MR], float* dst) {
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = (vf){0};
    vf s0 = {0}, s1 = {0};
    for (int64_t k = 0; k < K; k++) {
        vf b0, b1;
#if W_GROUP
        if (k % W_GROUP == 0) w_scales(sc + (k / W_GROUP) * NB, &s0, &s1);
#else
        (void)sc;
#endif
#if W_PREFETCH
        W_PREFETCH_ROW(b + k * W_ROW);
#endif
        w_row(b + k * W_ROW, s0, s1, &b0, &b1);
        vstore(dst + k * NB, b0);
        vstore(dst + k * NB + VL, b1);
        for (int m = 0; m < MM; m++) {
            const float s = a[m][k];
            acc0[m] += s * b0;
            acc1[m] += s * b1;
        }
    }
}
#define W_WIDE 1
#ifndef W_WIDE_ROWS
#define W_WIDE_ROWS (4 * MR) /* fewer rows (a decode step's 16: 3 blocks) widen in registers: faster */
#endif
#else
#define W_WIDE 0
#endif

/* ---- bfloat16 activations (mmserve_gemm_wa / mmserve_moe_wa with bf16 set): rows widened to
 * float32 once per call, results rounded to bfloat16 (nearest even, a NaN to 0xffff: what
 * torch's float32 -> bfloat16 conversion gives) as they are stored. The arithmetic is the
 * float32 path's, so a bfloat16 call equals widen -> float32 call -> torch's rounding bit for
 * bit, without the two conversions and tensors per linear. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* o[0..n) = bf16(v[0..n)), n <= NB */
static inline void bf16_store(uint16_t* o, const float* v, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i one = _mm256_set1_epi32(1), rnd = _mm256_set1_epi32(0x7fff), abs = _mm256_set1_epi32(0x7fffffff),
                  inf = _mm256_set1_epi32(0x7f800000), qnan = _mm256_set1_epi32(0xffff);
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_loadu_si256((const __m256i*)(v + i));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, rnd), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), qnan, _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i*)(o + i), _mm256_castsi256_si128(p));
    }
#endif
    for (; i < n; i++) o[i] = bf16_round(v[i]);
}

static inline void bf16_widen(float* dst, const uint16_t* src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i*)(dst + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + i))), 16));
#endif
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, 4);
    }
}

/* rows [R * i, R * (i + 1)) of a row-wise conversion, on the pool (ACT_ROWS rows an item) */
#define ACT_ROWS 32
typedef struct {
    const uint16_t* h;
    float* f;
    uint16_t* o;
    int64_t ldh, ldf, M, K;
} act_ctx;

static void widen_item(void* vctx, int64_t it) {
    const act_ctx* c = vctx;
    const int64_t r1 = (it + 1) * ACT_ROWS < c->M ? (it + 1) * ACT_ROWS : c->M;
    for (int64_t r = it * ACT_ROWS; r < r1; r++) bf16_widen(c->f + r * c->ldf, c->h + r * c->ldh, c->K);
}

static void narrow_item(void* vctx, int64_t it) {
    const act_ctx* c = vctx;
    const int64_t r1 = (it + 1) * ACT_ROWS < c->M ? (it + 1) * ACT_ROWS : c->M;
    for (int64_t r = it * ACT_ROWS; r < r1; r++)
        for (int64_t d = 0; d < c->K; d += NB)
            bf16_store(c->o + r * c->ldh + d, c->f + r * c->ldf + d, c->K - d < NB ? c->K - d : NB);
}

/* The calling thread's float32 scratch for a bfloat16 call's widened rows (and a MoE call's
 * float32 result) of n floats, grown and kept: a prefill chunk's is megabytes, and a fresh
 * malloc of that size is a fresh mmap whose page faults cost more than the widening (one MoE
 * layer at 512 tokens: +2%). One per thread, beside the tile scratch of the pool's threads. */
static __thread float* abuf;
static __thread int64_t acap;

static float* act_scratch(int64_t n) { return kept_scratch(&abuf, &acap, n); }

/* fn over the ceil(M / ACT_ROWS) row items: on the pool when the rows are many */
static void act_rows(chunk_fn_t fn, act_ctx* c, par_for_t par_for, int64_t threads) {
    const int64_t n = (c->M + ACT_ROWS - 1) / ACT_ROWS;
    if (par_for && threads > 1 && c->M * c->K >= (1 << 16)) par_for(fn, c, n, threads);
    else
        for (int64_t i = 0; i < n; i++) fn(c, i);
}

/* tile t (of tiles K deep) of a packed weight, and its scales (NULL for unscaled formats) */
static inline const uint8_t* tile_w(const uint8_t* w, int64_t t, int64_t K) { return w + t * K * W_ROW; }
static inline const wscale_t* tile_s(const wscale_t* s, int64_t t, int64_t K) {
    return s ? s + t * W_GROUPS(K) * NB : s;
}

typedef struct {
    const float* const* xrow; /* [P]: the pair's token row of x */
    const uint8_t *gp, *dp; /* packed weights (w_elem.h) */
    const wscale_t *gs, *ds; /* their scales (NULL unless the format has them) */
    const float* wp; /* [P]: the pair's routing weight */
    const int64_t *start, *tok; /* start [E + 1]: pairs of expert e are [start[e], start[e+1]) */
    float *h, *out;
    int64_t E, H, I, T;
    /* the row-group passes (prefill-sized calls): items (expert, first pair), per-pair outputs,
     * and each token's K pair positions in ascending order */
    const int64_t *item_e, *item_r0, *pos;
    float* ys;
    int64_t K;
} moe_ctx;

/* CALL(n) with a compile-time row count n = MMV (1..MR) */
#if MR == 12
#define TILE_SWITCH(MMV, CALL) \
    switch (MMV) { \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
        case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
        case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(12); break; \
    }
#elif MR == 8
#define TILE_SWITCH(MMV, CALL) \
    switch (MMV) { \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
        case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; \
    }
#else
#define TILE_SWITCH(MMV, CALL) \
    switch (MMV) { \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
        case 5: CALL(5); break; default: CALL(6); break; \
    }
#endif

/* pass 1, column block j of I (VL wide) for every expert */
/* h rows [r0, r1) (pairs of expert e), column block j: silu(x . gate^T) * (x . up^T) */
static inline void gate_up_tiles(const moe_ctx* c, int64_t e, int64_t j, int64_t r0, int64_t r1) {
    const int64_t H = c->H, I = c->I;
    const int64_t t = e * (I / VL) + j;
    const uint8_t* b = tile_w(c->gp, t, H);
    const wscale_t* sc = tile_s(c->gs, t, H);
    vf g[MR], u[MR];
    float* wf = NULL;
#if W_WIDE
    if (r1 - r0 > W_WIDE_ROWS) wf = tile_scratch(H * NB);
#endif
    for (int64_t r = r0; r < r1; r += MR) {
        const int mm = r1 - r < MR ? (int)(r1 - r) : MR;
        if (wf && r == r0) { /* the first block is a full one (more than W_WIDE_ROWS rows) */
#if W_WIDE
            tile_keep(c->xrow + r, b, sc, H, MR, g, u, wf);
#endif
        } else if (wf) {
#define GUF(N) tile_f(c->xrow + r, wf, H, N, g, u)
            TILE_SWITCH(mm, GUF)
#undef GUF
        } else {
#define GU(N) tile(c->xrow + r, b, sc, H, N, g, u)
            TILE_SWITCH(mm, GU)
#undef GU
        }
        for (int m = 0; m < mm; m++) {
            float gs[VL], us[VL], *o = c->h + (r + m) * I + j * VL;
            vstore(gs, g[m]);
            vstore(us, u[m]);
#pragma omp simd
            for (int i = 0; i < VL; i++) o[i] = gs[i] / (1.f + exp_neg(gs[i])) * us[i];
        }
    }
}

static void gate_up_block(void* vctx, int64_t j) {
    const moe_ctx* c = vctx;
    for (int64_t e = 0; e < c->E; e++) gate_up_tiles(c, e, j, c->start[e], c->start[e + 1]);
}

/* pass 2, column block j of H (2 VL wide) for every expert, in ascending expert order */
static void down_block(void* vctx, int64_t j) {
    const moe_ctx* c = vctx;
    const int64_t H = c->H, I = c->I;
    for (int64_t t = 0; t < c->T; t++) memset(c->out + t * H + j * 2 * VL, 0, 2 * VL * sizeof(float));
    vf y0[MR], y1[MR];
    const float* hr[MR];
    for (int64_t e = 0; e < c->E; e++) {
        const uint8_t* b = tile_w(c->dp, e * (H / NB) + j, I);
        const wscale_t* sc = tile_s(c->ds, e * (H / NB) + j, I);
        for (int64_t r = c->start[e]; r < c->start[e + 1]; r += MR) {
            const int mm = c->start[e + 1] - r < MR ? (int)(c->start[e + 1] - r) : MR;
            for (int m = 0; m < mm; m++) hr[m] = c->h + (r + m) * I;
#define DN(N) tile(hr, b, sc, I, N, y0, y1)
            TILE_SWITCH(mm, DN)
#undef DN
            for (int m = 0; m < mm; m++) {
                float* o = c->out + c->tok[r + m] * H + j * 2 * VL;
                const float s = c->wp[r + m];
                vstore(o, vload(o) + s * y0[m]);
                vstore(o + VL, vload(o + VL) + s * y1[m]);
            }
        }
    }
}

/* Prefill-sized calls: an item is up to MOE_RB pairs of one expert for every column block, so its
 * rows of x (or h) stay in L2 while the expert's weight panels stream past (a column-block item
 * re-reads every pair's row once per block: one MiMo MoE layer, 2,048 tokens, on a 2-core Xeon,
 * 215 GFLOP/s where linears of the same shapes run at ~350). Pass 2 stores each pair's product in
 * ys; pass 3 sums each token's pairs in ascending expert order, as the column-block pass does. */
#define MOE_RB (12 * MR)

static void gate_up_rows(void* vctx, int64_t it) {
    const moe_ctx* c = vctx;
    const int64_t e = c->item_e[it], r0 = c->item_r0[it];
    const int64_t r1 = r0 + MOE_RB < c->start[e + 1] ? r0 + MOE_RB : c->start[e + 1];
    for (int64_t j = 0; j < c->I / VL; j++) gate_up_tiles(c, e, j, r0, r1);
}

static void down_rows(void* vctx, int64_t it) {
    const moe_ctx* c = vctx;
    const int64_t H = c->H, I = c->I, e = c->item_e[it], r0 = c->item_r0[it];
    const int64_t r1 = r0 + MOE_RB < c->start[e + 1] ? r0 + MOE_RB : c->start[e + 1];
    vf y0[MR], y1[MR];
    const float* hr[MR];
    for (int64_t j = 0; j < H / (2 * VL); j++) {
        const uint8_t* b = tile_w(c->dp, e * (H / NB) + j, I);
        const wscale_t* sc = tile_s(c->ds, e * (H / NB) + j, I);
        float* wf = NULL;
#if W_WIDE
        if (r1 - r0 > W_WIDE_ROWS) wf = tile_scratch(I * NB);
#endif
        for (int64_t r = r0; r < r1; r += MR) {
            const int mm = r1 - r < MR ? (int)(r1 - r) : MR;
            for (int m = 0; m < mm; m++) hr[m] = c->h + (r + m) * I;
            if (wf && r == r0) {
#if W_WIDE
                tile_keep(hr, b, sc, I, MR, y0, y1, wf);
#endif
            } else if (wf) {
#define DNF(N) tile_f(hr, wf, I, N, y0, y1)
                TILE_SWITCH(mm, DNF)
#undef DNF
            } else {
#define DN(N) tile(hr, b, sc, I, N, y0, y1)
                TILE_SWITCH(mm, DN)
#undef DN
            }
            for (int m = 0; m < mm; m++) {
                float* o = c->ys + (r + m) * H + j * 2 * VL;
                vstore(o, y0[m]);
                vstore(o + VL, y1[m]);
            }
        }
    }
}

#define MOE_TOKENS 32 /* tokens per item of pass 3 */

static void combine_tokens(void* vctx, int64_t chunk) {
    const moe_ctx* c = vctx;
    const int64_t H = c->H, K = c->K, t1 = (chunk + 1) * MOE_TOKENS < c->T ? (chunk + 1) * MOE_TOKENS : c->T;
    for (int64_t t = chunk * MOE_TOKENS; t < t1; t++) {
        float* o = c->out + t * H;
        memset(o, 0, (size_t)H * sizeof(float));
        for (int64_t k = 0; k < K; k++) {
            const int64_t r = c->pos[t * K + k];
            const float s = c->wp[r], *y = c->ys + r * H;
            for (int64_t d = 0; d < H; d += VL) vstore(o + d, vload(o + d) + s * vload(y + d));
        }
    }
}

/* x [T, H] contiguous; idx [T, K] int64; w [T, K]; gp [E][I / VL] tiles H deep (gate VL | up VL
 * columns) and dp [E][H / 2VL] tiles I deep in this build's format (float32: packed by
 * mmserve_moe_pack_f32; the others by cpu_packed.py), gs / ds their scales (NULL if unscaled);
 * h: scratch of T * K * I floats; out [T, H]. Work items on par_for (the pool of cpu_gemv.c)
 * with up to `threads` threads, or on the caller when par_for is NULL. Returns 0; 1 if an
 * index is out of range, the shape is not packable, or memory is short (out untouched). */
static int moe_run(const float* x, int64_t T, int64_t H, const int64_t* idx, const float* w, int64_t K,
                   const uint8_t* gp, const wscale_t* gs, const uint8_t* dp, const wscale_t* ds, int64_t E, int64_t I,
                   float* h, float* out, par_for_t par_for, int64_t threads) {
    if (I % VL || H % (2 * VL)) return 1;
    const int64_t P = T * K;
    for (int64_t p = 0; p < P; p++)
        if (idx[p] < 0 || idx[p] >= E) return 1;
    int64_t* start = calloc(2 * (size_t)E + 1, sizeof(int64_t)); /* E + 1 offsets, then E fill counts */
    int64_t* tok = malloc((size_t)(P ? P : 1) * sizeof(int64_t));
    float* wp = malloc((size_t)(P ? P : 1) * sizeof(float));
    const float** xrow = malloc((size_t)(P ? P : 1) * sizeof(float*));
    if (!start || !tok || !wp || !xrow) {
        free(start); free(tok); free(wp); free(xrow);
        return 1;
    }
    for (int64_t p = 0; p < P; p++) start[idx[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t* fill = start + E + 1;
    for (int64_t p = 0; p < P; p++) { /* pairs grouped by expert, token order inside */
        const int64_t r = start[idx[p]] + fill[idx[p]]++;
        tok[r] = p / K;
        wp[r] = w[p];
        xrow[r] = x + (p / K) * H;
    }
    moe_ctx c = {(const float* const*)xrow, gp, dp, gs, ds, wp, start, tok, h, out, E, H, I, T};
    if (P >= MR * E) { /* prefill-sized (a full tile per expert on average): the row-group passes (above) */
        int rc = 0;
        int64_t items = 0;
        for (int64_t e = 0; e < E; e++) items += (start[e + 1] - start[e] + MOE_RB - 1) / MOE_RB;
        int64_t *ie = malloc((size_t)(items ? items : 1) * 2 * sizeof(int64_t)), *pos = malloc((size_t)P * sizeof(int64_t));
        float* ys = malloc((size_t)P * (size_t)H * sizeof(float));
        if (!ie || !pos || !ys) {
            rc = 1;
        } else {
            int64_t n = 0;
            for (int64_t e = 0; e < E; e++)
                for (int64_t r = start[e]; r < start[e + 1]; r += MOE_RB, n++) {
                    ie[n] = e;
                    ie[items + n] = r;
                }
            for (int64_t e = 0; e < E; e++) fill[e] = 0;
            for (int64_t p = 0; p < P; p++) pos[p] = start[idx[p]] + fill[idx[p]]++; /* as sorted above */
            for (int64_t t = 0; t < T; t++) /* each token's pairs in ascending position: expert order */
                for (int64_t a = 1; a < K; a++)
                    for (int64_t b = a; b > 0 && pos[t * K + b - 1] > pos[t * K + b]; b--) {
                        const int64_t v = pos[t * K + b];
                        pos[t * K + b] = pos[t * K + b - 1];
                        pos[t * K + b - 1] = v;
                    }
            c.item_e = ie;
            c.item_r0 = ie + items;
            c.pos = pos;
            c.ys = ys;
            c.K = K;
            const int64_t chunks = (T + MOE_TOKENS - 1) / MOE_TOKENS;
            if (par_for && threads > 1 && P * 3 * H * I >= MIN_PAR_MACS) {
                par_for(gate_up_rows, &c, items, threads);
                par_for(down_rows, &c, items, threads);
                par_for(combine_tokens, &c, chunks, threads);
            } else {
                for (int64_t i = 0; i < items; i++) gate_up_rows(&c, i);
                for (int64_t i = 0; i < items; i++) down_rows(&c, i);
                for (int64_t i = 0; i < chunks; i++) combine_tokens(&c, i);
            }
        }
        free(ie); free(pos); free(ys);
        free(start); free(tok); free(wp); free(xrow);
        return rc;
    }
    if (par_for && threads > 1 && P * 3 * H * I >= MIN_PAR_MACS) {
        par_for(gate_up_block, &c, I / VL, threads);
        par_for(down_block, &c, H / (2 * VL), threads);
    } else {
        for (int64_t j = 0; j < I / VL; j++) gate_up_block(&c, j);
        for (int64_t j = 0; j < H / (2 * VL); j++) down_block(&c, j);
    }
    free(start); free(tok); free(wp); free(xrow);
    return 0;
}

int mmserve_moe_w(const float* x, int64_t T, int64_t H, const int64_t* idx, const float* w, int64_t K,
                  const uint8_t* gp, const wscale_t* gs, const uint8_t* dp, const wscale_t* ds, int64_t E, int64_t I,
                  float* h, float* out, par_for_t par_for, int64_t threads) {
    return moe_run(x, T, H, idx, w, K, gp, gs, dp, ds, E, I, h, out, par_for, threads);
}

/* mmserve_moe_w with x and out of bfloat16 (uint16) when bf16 is nonzero, else float32: x widened
 * once, the float32 result rounded once (see bf16_store). Returns as mmserve_moe_w. */
int mmserve_moe_wa(const void* x, int64_t T, int64_t H, const int64_t* idx, const float* w, int64_t K,
                   const uint8_t* gp, const wscale_t* gs, const uint8_t* dp, const wscale_t* ds, int64_t E, int64_t I,
                   float* h, void* out, int64_t bf16, par_for_t par_for, int64_t threads) {
    if (!bf16) return moe_run(x, T, H, idx, w, K, gp, gs, dp, ds, E, I, h, out, par_for, threads);
    if (I % VL || H % (2 * VL)) return 1;
    float* xf = act_scratch((T ? T : 1) * H * 2); /* x, then the float32 result */
    if (!xf) return 1;
    float* of = xf + T * H;
    act_ctx c = {x, xf, out, H, H, T, H};
    act_rows(widen_item, &c, par_for, threads);
    const int rc = moe_run(xf, T, H, idx, w, K, gp, gs, dp, ds, E, I, h, of, par_for, threads);
    if (rc == 0) {
        c.f = of;
        act_rows(narrow_item, &c, par_for, threads);
    }
    return rc;
}

#if W_FORMAT == 0
int mmserve_moe_packed_f32(const float* x, int64_t T, int64_t H, const int64_t* idx, const float* w, int64_t K,
                           const float* gp, const float* dp, int64_t E, int64_t I, float* h, float* out,
                           par_for_t par_for, int64_t threads) {
    return mmserve_moe_w(x, T, H, idx, w, K, (const uint8_t*)gp, NULL, (const uint8_t*)dp, NULL, E, I, h, out,
                         par_for, threads);
}
#endif

/* ------------------------------------------------------------------------------- linears */

#if W_FORMAT == 0
/* w [N, K] (a linear's weight) -> wp [ceil(N / NB)][K][NB], the last block's missing columns 0 */
int mmserve_gemm_pack_f32(const float* w, int64_t N, int64_t K, float* wp) {
    const int64_t nb = (N + NB - 1) / NB;
    for (int64_t j = 0; j < nb; j++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < NB; c++) {
                const int64_t n = j * NB + c;
                wp[(j * K + k) * NB + c] = n < N ? w[n * K + k] : 0.f;
            }
    return 0;
}
#endif

typedef struct {
    const float *x, *bias;
    const uint8_t* wp;
    const wscale_t* ws;
    float* out;
    uint16_t* outh; /* bfloat16 output (out unused), or NULL */
    int64_t ldx, ldo, M, N, K, nb, rb;
} gemm_ctx;

/* rows per work item: 12 MR x K floats stay in L2 while its column blocks run, fewer rows (whole
 * tiles) where K would take more than GEMM_L2 bytes */
#define GEMM_RB (12 * MR)
#define GEMM_L2 (512 * 1024)

static void gemm_item(void* vctx, int64_t it) {
    const gemm_ctx* c = vctx;
    const int64_t j = it % c->nb, r0 = (it / c->nb) * c->rb;
    const int64_t r1 = r0 + c->rb < c->M ? r0 + c->rb : c->M;
    const int64_t K = c->K, n0 = j * NB, nn = c->N - n0 < NB ? c->N - n0 : NB;
    const uint8_t* b = tile_w(c->wp, j, K);
    const wscale_t* sc = tile_s(c->ws, j, K);
    float bias[NB];
    for (int64_t n = 0; n < NB; n++) bias[n] = c->bias && n < nn ? c->bias[n0 + n] : 0.f;
    const vf b0 = vload(bias), b1 = vload(bias + VL);
    vf y0[MR], y1[MR];
    const float* a[MR];
    float* wf = NULL;
#if W_WIDE
    if (r1 - r0 > W_WIDE_ROWS) wf = tile_scratch(K * NB);
#endif
    for (int64_t r = r0; r < r1; r += MR) {
        const int mm = r1 - r < MR ? (int)(r1 - r) : MR;
        for (int m = 0; m < mm; m++) a[m] = c->x + (r + m) * c->ldx;
        if (wf && r == r0) {
#if W_WIDE
            tile_keep(a, b, sc, K, MR, y0, y1, wf);
#endif
        } else if (wf) {
#define GMF(N) tile_f(a, wf, K, N, y0, y1)
            TILE_SWITCH(mm, GMF)
#undef GMF
        } else {
#define GM(N) tile(a, b, sc, K, N, y0, y1)
            TILE_SWITCH(mm, GM)
#undef GM
        }
        if (c->outh) {
            for (int m = 0; m < mm; m++) {
                float t[NB];
                vstore(t, y0[m] + b0);
                vstore(t + VL, y1[m] + b1);
                bf16_store(c->outh + (r + m) * c->ldo + n0, t, nn);
            }
            continue;
        }
        for (int m = 0; m < mm; m++) {
            float* o = c->out + (r + m) * c->ldo + n0;
            if (nn == NB) {
                vstore(o, y0[m] + b0);
                vstore(o + VL, y1[m] + b1);
            } else {
                float t[NB];
                vstore(t, y0[m] + b0);
                vstore(t + VL, y1[m] + b1);
                memcpy(o, t, (size_t)nn * sizeof(float));
            }
        }
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) . w^T + bias (bias [N] or NULL), w
 * packed [ceil(N / NB)] tiles K deep in this build's format (float32: by mmserve_gemm_pack_f32),
 * ws its scales (NULL if unscaled); work items (GEMM_RB rows or fewer x NB columns) on par_for
 * as above. */
static void gemm_run(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const wscale_t* ws,
                     int64_t N, const float* bias, float* out, uint16_t* outh, int64_t ldo, par_for_t par_for,
                     int64_t threads) {
    int64_t rb = GEMM_L2 / (K * (int64_t)sizeof(float)) / MR * MR;
    rb = rb < MR ? MR : rb > GEMM_RB ? GEMM_RB : rb;
    const int64_t nb = (N + NB - 1) / NB, items = nb * ((M + rb - 1) / rb);
    gemm_ctx c = {x, bias, wp, ws, out, outh, ldx, ldo, M, N, K, nb, rb};
    if (par_for && threads > 1 && M * N * K >= MIN_PAR_MACS) par_for(gemm_item, &c, items, threads);
    else
        for (int64_t i = 0; i < items; i++) gemm_item(&c, i);
}

int mmserve_gemm_w(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const wscale_t* ws,
                   int64_t N, const float* bias, float* out, int64_t ldo, par_for_t par_for, int64_t threads) {
    gemm_run(x, ldx, M, K, wp, ws, N, bias, out, NULL, ldo, par_for, threads);
    return 0;
}

/* mmserve_gemm_w with x [M, K] (row stride ldx) and out [M, N] (row stride ldo) of bfloat16
 * (uint16) when bf16 is nonzero: x widened once into scratch, each output tile rounded as it is
 * stored (bf16_store); bias float32 either way. Returns 0, 1 if memory is short (out untouched). */
int mmserve_gemm_wa(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const wscale_t* ws,
                    int64_t N, const float* bias, void* out, int64_t ldo, int64_t bf16, par_for_t par_for,
                    int64_t threads) {
    if (!bf16) {
        gemm_run(x, ldx, M, K, wp, ws, N, bias, out, NULL, ldo, par_for, threads);
        return 0;
    }
    float* xf = act_scratch((M ? M : 1) * K);
    if (!xf) return 1;
    act_ctx c = {x, xf, NULL, ldx, K, M, K};
    act_rows(widen_item, &c, par_for, threads);
    gemm_run(xf, K, M, K, wp, ws, N, bias, NULL, out, ldo, par_for, threads);
    return 0;
}

#if W_FORMAT == 0
int mmserve_gemm_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* wp, int64_t N, const float* bias,
                     float* out, int64_t ldo, par_for_t par_for, int64_t threads) {
    return mmserve_gemm_w(x, ldx, M, K, (const uint8_t*)wp, NULL, N, bias, out, ldo, par_for, threads);
}
#endif
