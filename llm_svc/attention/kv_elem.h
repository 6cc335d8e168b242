/* A KV pool's element type and its widening to float32, one per build (llm_svc.ckernels
 * kv_dtype_builds): float32 by default, -DKV_BF16 or -DKV_F16 for bfloat16 / float16 pools.
 * Included by the decode and prefill kernels; their builds' cache keys hash this file too. */
#ifndef MMSERVE_KV_ELEM_H
#define MMSERVE_KV_ELEM_H
#include <stdint.h>

#if defined(KV_BF16)
typedef uint16_t kv_t;
static inline float kv_f(kv_t h)
{
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}
#elif defined(KV_F16)
typedef _Float16 kv_t;
static inline float kv_f(kv_t h) { return (float)h; }
#else
typedef float kv_t;
static inline float kv_f(kv_t h) { return h; }
#endif

#endif
