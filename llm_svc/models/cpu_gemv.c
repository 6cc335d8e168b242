/* Linears of a few rows (decode steps): out[m, n] = x[m, :] . w[n, :] + bias[n], float32.
 *
 * With 1-8 rows a linear is bound by streaming its weight once from memory; oneDNN's GEMM for
 * such shapes reached 3-8 GB/s on the 2-core dev VMs. Here each weight row is read once for all
 * rows of x (x stays in L1), two weight rows at a time against four x rows (8 accumulators),
 * and the output rows are split into blocks over the threads of an elastic pool (below).
 *
 * x [M, K] with row stride ldx; w [N, K] contiguous; bias [N] or NULL; out [M, N] with row
 * stride ldo. Returns 0.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdatomic.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

/* ---------------------------------------------------------------------------------- the pool
 * An elastic parallel-for: the caller runs chunks itself and persistent helper threads join in
 * when they are on a core. The caller never waits for a helper that has not started: it claims
 * chunks until none are left, then waits only for chunks a helper has claimed and not finished.
 * An OpenMP loop's barrier instead waits for every thread of the team, so whenever a process
 * beside the engine (the front, the gateway, a client) takes the other core, each of a decode
 * step's ~40 linears waited for its time slice: in the service two threads gave nothing over one.
 *
 * claim: (generation << 48) | (front << 24) | back; chunks [front, back) are left. A job's fn /
 * ctx / n sit in slot gen & 1; the caller writes them before it publishes the generation, and
 * does not reuse a slot before the job two generations back is done, so a helper that claims
 * with a compare-exchange on a current generation reads a stable slot (a stale helper's exchange
 * fails). Helpers spin a little, then yield, then sleep on a futex. */
typedef void (*chunk_fn)(void* ctx, int64_t i);
typedef struct { chunk_fn fn; void* ctx; int64_t n; int64_t helpers; } job_t;

#define POOL_MAX 63
static _Atomic uint64_t pool_claim;
static _Atomic int64_t pool_done;
static _Atomic uint32_t pool_wake; /* futex word: the generation helpers may wait on */
static _Atomic int pool_sleepers;
static job_t pool_job[2];
static int pool_started; /* helpers running (the caller's thread only) */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static int pool_pid; /* after a fork the helpers are gone: start again */
static atomic_flag pool_busy = ATOMIC_FLAG_INIT; /* a second concurrent caller runs serially */

static long futex(_Atomic uint32_t* addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t*)addr, op, val, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define CL_GEN(c) ((uint32_t)((c) >> 48))
#define CL_FRONT(c) ((int64_t)(((c) >> 24) & 0xffffff))
#define CL_BACK(c) ((int64_t)((c) & 0xffffff))

/* a helper runs the current job's chunks from the back while any are left (the caller takes
 * them from the front: each thread streams a contiguous run of the weight, as a static split
 * would, and they meet where the slower one is) */
static void pool_work(uint32_t gen, int64_t helper) {
    uint64_t c = atomic_load_explicit(&pool_claim, memory_order_acquire);
    for (;;) {
        if (CL_GEN(c) != (gen & 0xffff)) return;
        const job_t* j = &pool_job[gen & 1];
        if (CL_FRONT(c) >= CL_BACK(c) || helper >= j->helpers) return;
        if (!atomic_compare_exchange_weak_explicit(&pool_claim, &c, c - 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        /* claimed chunk back - 1 of this generation: the job cannot finish (nor its slot change) first */
        j->fn(j->ctx, CL_BACK(c) - 1);
        atomic_fetch_add_explicit(&pool_done, 1, memory_order_release);
        c = atomic_load_explicit(&pool_claim, memory_order_acquire);
    }
}

static void* pool_helper(void* arg) {
    const int64_t me = (int64_t)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool_wake);
    for (;;) {
        uint32_t g = atomic_load_explicit(&pool_wake, memory_order_acquire);
        /* ~20-50 us of pause, then ~1 ms of yielding the core to anyone runnable, then sleep */
        for (int spin = 0; g == seen && spin < 2000; spin++) {
            cpu_relax();
            g = atomic_load_explicit(&pool_wake, memory_order_acquire);
        }
        for (int spin = 0; g == seen && spin < 200; spin++) {
            sched_yield();
            g = atomic_load_explicit(&pool_wake, memory_order_acquire);
        }
        if (g == seen) {
            atomic_fetch_add(&pool_sleepers, 1);
            if (atomic_load(&pool_wake) == seen) futex(&pool_wake, FUTEX_WAIT_PRIVATE, seen);
            atomic_fetch_sub(&pool_sleepers, 1);
            continue;
        }
        seen = g;
        pool_work(g, me);
    }
    return NULL;
}

static void pool_ensure(int64_t helpers) {
    if (pool_pid != getpid()) { pool_started = 0; pool_pid = getpid(); }
    if (pool_started >= helpers) return;
    pthread_mutex_lock(&pool_lock);
    while (pool_started < helpers && pool_started < POOL_MAX) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &a, pool_helper, (void*)(intptr_t)pool_started);
        pthread_attr_destroy(&a);
        if (rc != 0) break;
        pool_started++;
    }
    pthread_mutex_unlock(&pool_lock);
}

/* fn(ctx, i) for every i in [0, n), on the caller and up to threads - 1 helpers. One caller at a
 * time (the engine's step thread); any chunk may run on any thread, so results must not depend
 * on which. */
static void par_for(chunk_fn fn, void* ctx, int64_t n, int64_t threads) {
    if (threads <= 1 || n < 2 || n > 0xffffff || atomic_flag_test_and_set(&pool_busy)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    pool_ensure(threads - 1);
    const uint32_t gen = (CL_GEN(atomic_load_explicit(&pool_claim, memory_order_relaxed)) + 1) & 0xffff;
    job_t* j = &pool_job[gen & 1];
    j->fn = fn; j->ctx = ctx; j->n = n; j->helpers = threads - 1;
    atomic_store_explicit(&pool_done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool_claim, ((uint64_t)gen << 48) | (uint64_t)n, memory_order_release);
    atomic_store(&pool_wake, gen); /* seq_cst: against a helper's sleepers++ then load of pool_wake */
    if (atomic_load(&pool_sleepers) > 0) futex(&pool_wake, FUTEX_WAKE_PRIVATE, POOL_MAX);
    uint64_t c = atomic_load_explicit(&pool_claim, memory_order_acquire);
    while (CL_FRONT(c) < CL_BACK(c)) { /* the caller takes chunks from the front */
        if (!atomic_compare_exchange_weak_explicit(&pool_claim, &c, c + ((uint64_t)1 << 24), memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(ctx, CL_FRONT(c));
        atomic_fetch_add_explicit(&pool_done, 1, memory_order_release);
        c = atomic_load_explicit(&pool_claim, memory_order_acquire);
    }
    /* only chunks a helper claimed are left: wait for those */
    for (int spin = 0; atomic_load_explicit(&pool_done, memory_order_acquire) < n; spin++) {
        if (spin < 4096) cpu_relax(); else sched_yield();
    }
    atomic_flag_clear(&pool_busy);
}

/* The pool for other kernels of this process (the attention kernels' libraries take this
 * function's address from cpu_gemv.par_for_address): fn(ctx, i) for i in [0, n) on up to
 * ``threads`` threads, as par_for. */
void mmserve_par_for(chunk_fn fn, void* ctx, int64_t n, int64_t threads) { par_for(fn, ctx, n, threads); }

/* helpers started (for tests) */
int64_t mmserve_pool_helpers(void) { return pool_pid == getpid() ? pool_started : 0; }

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

typedef struct { const float *x, *w, *bias; float* out; int64_t ldx, ldo, M, N, K; } gemv_args;

static void gemv_block(void* ctx, int64_t b) {
    const gemv_args* a = ctx;
    const int64_t n0 = b * BLOCK_ROWS, n1 = n0 + BLOCK_ROWS < a->N ? n0 + BLOCK_ROWS : a->N;
    ROWS(a->x, a->ldx, a->w, a->bias, a->out, a->ldo, a->M, a->K, n0, n1);
}

int mmserve_gemv_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t ldo,
                     int64_t M, int64_t N, int64_t K, int64_t threads) {
    const int64_t blocks = (N + BLOCK_ROWS - 1) / BLOCK_ROWS;
    if (threads <= 1 || blocks < 2) {
        ROWS(x, ldx, w, bias, out, ldo, M, K, 0, N);
        return 0;
    }
    gemv_args a = {x, w, bias, out, ldx, ldo, M, N, K};
    par_for(gemv_block, &a, blocks, threads);
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

typedef struct { const float *xs, *gate_up, *down; float *gu, *ys; const int64_t *start, *list; int64_t H, I; } moe_args;

static void moe_expert(void* ctx, int64_t u) {
    const moe_args* a = ctx;
    const int64_t e = a->list[u], H = a->H, I = a->I;
    const int64_t r0 = a->start[e], c = a->start[e + 1] - r0;
    float* g = a->gu + r0 * 2 * I;
    ROWS(a->xs + r0 * H, H, a->gate_up + e * 2 * I * H, NULL, g, 2 * I, c, H, 0, 2 * I);
    for (int64_t j = 0; j < c; j++) { /* the activation in place over the gate half */
        float* row = g + j * 2 * I;
        for (int64_t i = 0; i < I; i++) {
            row[i] = row[i] / (1.f + exp_neg(row[i])) * row[I + i]; /* silu(gate) * up */
        }
    }
    ROWS(g, 2 * I, a->down + e * H * I, NULL, a->ys + r0 * H, H, c, I, 0, H);
}

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
    int64_t used[256 + 1], nu = 0; /* the experts with tokens, one chunk each */
    int64_t* list = E <= 256 ? used : malloc((size_t)E * sizeof(int64_t));
    if (!list) {
        free(start); free(pair); free(xs); free(gu); free(ys);
        return 1;
    }
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) list[nu++] = e;
    moe_args a = {xs, gate_up, down, gu, ys, start, list, H, I};
    par_for(moe_expert, &a, nu, threads);
    if (list != used) free(list);
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

/* MiMo's router (one group: n_group = 1): scores = sigmoid(x . wr[e]); the K experts of highest
 * score + bias[e] (bias steers the choice only), in descending order, ties to the lower index;
 * weights = their raw scores, divided by their sum when norm, times scale. x [T, H]; wr [E, H];
 * bias [E] or NULL; idx [T, K] int64 out; w [T, K] out. Blocks of ROUTE_ROWS tokens on the pool
 * (a prefill's router in torch was ~10 small ops, ~0.9 ms a layer at 320 tokens). Returns 0, 1
 * if K > E or E > 256. */
#define ROUTE_ROWS 16
typedef struct { const float *x, *wr, *bias; int64_t T, H, E, K, norm; float scale; int64_t* idx; float* w; } route_args;

static void route_block(void* ctx, int64_t b) {
    const route_args* a = ctx;
    const int64_t t0 = b * ROUTE_ROWS, n = a->T - t0 < ROUTE_ROWS ? a->T - t0 : ROUTE_ROWS;
    const int64_t E = a->E, K = a->K;
    float s[ROUTE_ROWS][256], c[256];
    unsigned char taken[256]; /* not a NaN mark: -ffast-math assumes there are none */
    ROWS(a->x + t0 * a->H, a->H, a->wr, NULL, &s[0][0], 256, n, a->H, 0, E);
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = t0 + j;
        float* sj = s[j];
        memset(taken, 0, sizeof taken);
        for (int64_t e = 0; e < E; e++) {
            sj[e] = 1.f / (1.f + exp_neg(sj[e]));
            c[e] = sj[e] + (a->bias ? a->bias[e] : 0.f);
        }
        float sum = 0.f;
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || c[e] > c[best])) best = e;
            a->idx[t * K + k] = best;
            a->w[t * K + k] = sj[best];
            sum += sj[best];
            taken[best] = 1;
        }
        for (int64_t k = 0; k < K; k++) {
            float v = a->w[t * K + k];
            if (a->norm) v = v / (sum + 1e-20f);
            a->w[t * K + k] = v * a->scale;
        }
    }
}

int mmserve_route_f32(const float* x, int64_t T, int64_t H, const float* wr, const float* bias, int64_t E,
                      int64_t K, int64_t norm, float scale, int64_t* idx, float* w, int64_t threads) {
    if (K > E || E > 256) return 1;
    route_args a = {x, wr, bias, T, H, E, K, norm, scale, idx, w};
    par_for(route_block, &a, (T + ROUTE_ROWS - 1) / ROUTE_ROWS, threads);
    return 0;
}

/* act(gate) * up of a gated MLP's fused projection: gu [T, 2I] (gate | up, row stride ld) ->
 * out [T, I] (contiguous), rows over threads; SiLU here, tanh-GELU below. */
typedef struct { const float* gu; float* out; int64_t ld, I; } gated_args;

static void silu_row(void* ctx, int64_t t) {
    const gated_args* a = ctx;
    const float* g = a->gu + t * a->ld;
    const float* u = g + a->I;
    float* o = a->out + t * a->I;
    for (int64_t i = 0; i < a->I; i++) o[i] = g[i] / (1.f + exp_neg(g[i])) * u[i];
}

int mmserve_silu_mul_f32(const float* gu, int64_t ld, float* out, int64_t T, int64_t I, int64_t threads) {
    gated_args a = {gu, out, ld, I};
    par_for(silu_row, &a, T, threads);
    return 0;
}

/* gelu_tanh(gate) * up, the same way (Gemma's MLPs: transformers' gelu_pytorch_tanh,
 * 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3)), as g / (1 + e^(-2z)): the same
 * value with no cancellation (1 + tanh(z) written as 2 - 2 / (1 + e^(2z)) left an ulp of 2 where
 * it should vanish, with -ffast-math's approximate division on AVX2: -3e-5 for g = -20, u = 22).
 * z clamped to +-40 (e^80 is finite in float). torch's own gelu took ~0.9 ms a layer at 320 tokens. */
static void gelu_tanh_row(void* ctx, int64_t t) {
    const gated_args* a = ctx;
    const float* g = a->gu + t * a->ld;
    const float* u = g + a->I;
    float* o = a->out + t * a->I;
    for (int64_t i = 0; i < a->I; i++) {
        const float x = g[i];
        const float z = fminf(fmaxf(0.7978845608028654f * (x + 0.044715f * x * x * x), -40.f), 40.f);
        o[i] = x / (1.f + expf(-2.f * z)) * u[i];
    }
}

int mmserve_gelu_tanh_mul_f32(const float* gu, int64_t ld, float* out, int64_t T, int64_t I, int64_t threads) {
    gated_args a = {gu, out, ld, I};
    par_for(gelu_tanh_row, &a, T, threads);
    return 0;
}
