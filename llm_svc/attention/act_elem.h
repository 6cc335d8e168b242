/* The activations' element type, one per build (llm_svc.kernels.ckernels act_dtype_builds):
 * float32 by default, bfloat16 with -DACT_BF16. Kernels compute in float32 either way: a
 * bfloat16 build widens its inputs a row (or a vector) at a time as it reads them and rounds its
 * results back to bfloat16 (round to nearest even) as it writes them.
 *
 * The conversions: AVX-512 BF16 (vcvtneps2bf16, 16 lanes) where the build's CPU has it, else a
 * portable integer rounding (8 lanes of AVX2 integer ops where the build has AVX2, the same
 * rounding as the scalar form, NaNs included); ``mmserve_act_path()`` names the one
 * this build took (the service logs it once at start). The two agree on every finite value but
 * subnormals, which the instruction flushes to zero (below 1.2e-38: never a model's activation).
 * Included by cpu_fused.c, cpu_paged.c and cpu_prefill.c; their builds' cache keys hash it too. */
#ifndef MMSERVE_ACT_ELEM_H
#define MMSERVE_ACT_ELEM_H
#include <stdint.h>
#include <string.h>
#if (defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* ---- bfloat16 <-> float32, independent of the build's activation type (the KV write uses them) */
static inline float bf16_f(uint16_t h)
{
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

/* round to nearest even; a NaN stays a (quiet) NaN */
static inline uint16_t bf16_of(float f)
{
    union { float f; uint32_t u; } x = {f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__)
/* bf16_of on 8 lanes (AVX2 integer ops: the same rounding, NaNs included) -> 8 bfloat16 in the
 * low 16 bits of each 32-bit lane. The compiler left the scalar form's NaN branch unvectorized:
 * a bfloat16 add + RMSNorm pass took twice the float32 one's time on an AVX2 EPYC. */
static inline __m256i bf16_of8(__m256i u)
{
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, nan);
}
#endif

/* dst[i] = float(src[i]), i < n */
static inline void bf16_load_row(float *dst, const uint16_t *src, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16));
#endif
    for (; i < n; ++i) dst[i] = bf16_f(src[i]);
}

/* dst[i] = bf16(src[i]), i < n */
static inline void bf16_store_row(uint16_t *dst, const float *src, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
        return;
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256i r = bf16_of8(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
    }
#endif
    for (; i < n; ++i) dst[i] = bf16_of(src[i]);
}

/* x[i] = float(bf16(x[i])) in place: one eager bfloat16 op's rounding of a float32 result */
static inline void bf16_round_row(float *x, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; i + 16 <= n; i += 16) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        _mm512_storeu_ps(x + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(x + i), _mm256_slli_epi32(bf16_of8(_mm256_loadu_si256((const __m256i *)(x + i))), 16));
#endif
    for (; i < n; ++i) x[i] = bf16_f(bf16_of(x[i]));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BF16_CVT_PATH "avx512_bf16"
#else
#define BF16_CVT_PATH "portable"
#endif

/* ---- the build's activation type */
#if defined(ACT_BF16)
typedef uint16_t act_t;
#define ACT_IS_F32 0
static inline float act_f(act_t h) { return bf16_f(h); }
static inline act_t act_of(float f) { return bf16_of(f); }
static inline void act_load_row(float *dst, const act_t *src, int64_t n) { bf16_load_row(dst, src, n); }
static inline void act_store_row(act_t *dst, const float *src, int64_t n) { bf16_store_row(dst, src, n); }
static inline void act_round_row(float *x, int64_t n) { bf16_round_row(x, n); }
#define ACT_PATH "bfloat16/" BF16_CVT_PATH
#else
typedef float act_t;
#define ACT_IS_F32 1
static inline float act_f(act_t h) { return h; }
static inline act_t act_of(float f) { return f; }
static inline void act_load_row(float *dst, const act_t *src, int64_t n) { memcpy(dst, src, sizeof(float) * (size_t)n); }
static inline void act_store_row(act_t *dst, const float *src, int64_t n) { memcpy(dst, src, sizeof(float) * (size_t)n); }
static inline void act_round_row(float *x, int64_t n) { (void)x; (void)n; }
#define ACT_PATH "float32"
#endif

/* Which element type and conversion path this build took (e.g. "bfloat16/avx512_bf16"). */
const char *mmserve_act_path(void) { return ACT_PATH; }

#endif
