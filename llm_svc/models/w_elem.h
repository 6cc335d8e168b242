/* Weight elements of the packed GEMM / MoE kernels (cpu_packed.c), one format per build:
 *
 *   (default)   float32, 4 bytes a weight
 *   -DW_BF16    bfloat16, 2 bytes
 *   -DW_FP8     FP8 e4m3 with block scales (DeepSeek-V3 / MiMo-V2-Flash: 128 x 128 blocks), 1 byte
 *               plus one float32 scale per (column, 128-deep K group) of a tile
 *   -DW_MXFP4   E2M1 nibbles with an E8M0 byte scale per (column, 32-deep K group) (gpt-oss),
 *               1/2 + 1/32 byte
 *
 * A tile (NB = 2 VL columns) is stored K-major: row k of a tile is W_ROW bytes, its NB weights
 * in column order (MXFP4: byte i holds column i in its low nibble and column VL + i in its
 * high nibble). Scaled formats keep a tile's scales as [ceil(K / W_GROUP)][NB] (wscale_t), so a
 * scale may change at any column: the per-row scale rows of a fused projection whose scale
 * grid restarts per row chunk (MiMo's qkv_proj) need nothing special.
 *
 * w_row widens one row of a tile to float32 (b0: columns 0..VL-1, b1: VL..2VL-1) with the
 * group's scales already applied, in registers: a decode step streams the narrow weight. The
 * scale multiplies the weight, not the partial sums: the MR x 2 accumulators of the AVX-512
 * micro-tile already take 24 of 32 registers, and the widened weight is then the dequantized
 * weight bit for bit (the tests compare against dequantize-then-matmul).
 *
 * FP8 is widened exactly: the byte sign-extended, shifted so its 4 exponent and 3 mantissa bits
 * land in float16's, converted to float32 (F16C: exact, e4m3 subnormals included) and multiplied
 * by scale * 2^8 (the exponent-bias difference, folded into the stored scale at pack time). The
 * same bits placed straight in a float32 would make every e4m3 subnormal a float32 denormal,
 * and a multiply with a denormal input takes a microcode assist: 10x slower on random weights. */
#ifndef MMSERVE_W_ELEM_H
#define MMSERVE_W_ELEM_H
#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(W_BF16)
#define W_FORMAT 1
#define W_ROW (NB * 2)
#define W_GROUP 0
typedef float wscale_t;
#elif defined(W_FP8)
#define W_FORMAT 2
#define W_ROW NB
#define W_GROUP 128
typedef float wscale_t;
#elif defined(W_MXFP4)
#define W_FORMAT 3
#define W_ROW (NB / 2)
#define W_GROUP 32
typedef uint8_t wscale_t;
#else
#define W_FORMAT 0
#define W_ROW (NB * 4)
#define W_GROUP 0
typedef float wscale_t;
#endif

/* scale groups of a tile K deep (0 for unscaled formats) */
#define W_GROUPS(K) (W_GROUP ? ((K) + W_GROUP - 1) / W_GROUP : 0)

#if defined(W_MXFP4)
static const float w_fp4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
#endif

/* the NB scales of one group -> s0 (columns 0..VL-1), s1 */
static inline __attribute__((always_inline)) void w_scales(const wscale_t* s, vf* s0, vf* s1) {
#if defined(W_MXFP4)
#if defined(__AVX512F__) && VL == 16
    *s0 = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)s)), 23));
    *s1 = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + VL))), 23));
#elif defined(__AVX2__) && VL == 8
    *s0 = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)s)), 23));
    *s1 = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + VL))), 23));
#else
    float t[2 * VL];
    for (int i = 0; i < 2 * VL; i++) {
        const uint32_t bits = (uint32_t)s[i] << 23; /* E8M0: 2^(byte - 127); byte 0 reads as 0 */
        memcpy(t + i, &bits, 4);
    }
    memcpy(s0, t, sizeof *s0);
    memcpy(s1, t + VL, sizeof *s1);
#endif
#elif W_GROUP
    memcpy(s0, s, sizeof *s0);
    memcpy(s1, s + VL, sizeof *s1);
#else
    (void)s;
    *s0 = *s1 = (vf){0};
#endif
}

/* row p of a tile (W_ROW bytes) -> b0, b1 float32, scaled by s0, s1 where the format has scales */
static inline __attribute__((always_inline)) void w_row(const uint8_t* p, vf s0, vf s1, vf* b0, vf* b1) {
#if defined(W_BF16)
    (void)s0; (void)s1;
#if defined(__AVX512F__) && VL == 16
    *b0 = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    *b1 = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 32))), 16));
#elif defined(__AVX2__) && VL == 8
    *b0 = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    *b1 = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16))), 16));
#else
    float t[2 * VL];
    for (int i = 0; i < 2 * VL; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        const uint32_t bits = (uint32_t)h << 16;
        memcpy(t + i, &bits, 4);
    }
    memcpy(b0, t, sizeof *b0);
    memcpy(b1, t + VL, sizeof *b1);
#endif
#elif defined(W_FP8)
    /* e4m3 -> the float16 of the same value / 2^8: sign to bit 15, exponent and mantissa to bits
     * 7..13; the conversion to float32 (F16C) is exact, subnormals included */
#if defined(__AVX512F__) && VL == 16
    const __m256i m = _mm256_set1_epi16((short)0xBF80);
    *b0 = (vf)_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), 7), m)) * s0;
    *b1 = (vf)_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16))), 7), m)) * s1;
#elif defined(__AVX2__) && defined(__F16C__) && VL == 8
    const __m128i m = _mm_set1_epi16((short)0xBF80);
    *b0 = (vf)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p)), 7), m)) * s0;
    *b1 = (vf)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(p + 8))), 7), m)) * s1;
#else
    float t[2 * VL];
    for (int i = 0; i < 2 * VL; i++) { /* sign * 2^(e - 15) * (1 + m / 8), or 2^-14 * m / 8 for e = 0 */
        const int e = (p[i] >> 3) & 15, mm = p[i] & 7;
        const float v = e ? ldexpf(1.f + mm / 8.f, e - 15) : ldexpf(mm / 8.f, -14);
        t[i] = p[i] & 0x80 ? -v : v;
    }
    vf v0, v1;
    memcpy(&v0, t, sizeof v0);
    memcpy(&v1, t + VL, sizeof v1);
    *b0 = v0 * s0;
    *b1 = v1 * s1;
#endif
#elif defined(W_MXFP4)
#if defined(__AVX512F__) && VL == 16
    const __m512 lut = _mm512_loadu_ps(w_fp4);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    *b0 = (vf)_mm512_permutexvar_ps(v, lut) * s0; /* the index's low 4 bits: the low nibble */
    *b1 = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut) * s1;
#elif defined(__AVX2__) && VL == 8
    const __m256 lut = _mm256_loadu_ps(w_fp4); /* magnitudes; the sign is bit 3 of the nibble */
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i sg = _mm256_set1_epi32((int)0x80000000u);
    const __m256 lo = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, v),
                                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 28), sg)));
    const __m256 hi = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, _mm256_srli_epi32(v, 4)),
                                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 24), sg)));
    *b0 = (vf)lo * s0;
    *b1 = (vf)hi * s1;
#else
    float t[2 * VL];
    for (int i = 0; i < VL; i++) {
        t[i] = w_fp4[p[i] & 15];
        t[VL + i] = w_fp4[p[i] >> 4];
    }
    vf v0, v1;
    memcpy(&v0, t, sizeof v0);
    memcpy(&v1, t + VL, sizeof v1);
    *b0 = v0 * s0;
    *b1 = v1 * s1;
#endif
#else
    (void)s0; (void)s1;
    memcpy(b0, p, sizeof *b0);
    memcpy(b1, p + VL * 4, sizeof *b1);
#endif
}
#endif
