/* What every kernel source shares: bf16 <-> fp32, rows of either, lane sums, the weights'
 * prefetch and the row-count dispatch of the int4/int8 kernels. Included by each .c here; no
 * .c includes another. */
#ifndef LOCALSERVE_COMMON_H
#define LOCALSERVE_COMMON_H
#include <stdint.h>
#include <string.h>

/* bf16 -> fp32: exact. */
static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, rounded to nearest even; a NaN stays a (quiet) NaN of its sign, where rounding
 * its bits could carry into the exponent and make it an infinity. The vector instructions
 * (vcvtneps2bf16) round alike. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* n values from src (fp32 or bf16) into fp32 dst. */
static inline void load_row(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)  /* vfpclassps: AVX-512 DQ */
#include <immintrin.h>
/* 16 fp32 to bf16 as float_to_bf16 rounds them, into dst. vcvtneps2bf16 rounds alike, NaNs
 * included, but flushes denormal inputs to zero (every one of the 2^32 inputs checked on an
 * Intel Xeon with AMX), so a vector with a denormal lane takes float_to_bf16 lane by lane. */
static inline void bf16x16_store(uint16_t *dst, __m512 v) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) {  /* 0x20: denormal */
        float f[16];
        _mm512_storeu_ps(f, v);
        for (int i = 0; i < 16; i++) dst[i] = float_to_bf16(f[i]);
        return;
    }
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

/* n fp32 values into dst (fp32, or bf16 rounded as float_to_bf16). */
static inline void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst;
        int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
        for (; i + 16 <= n; i += 16) bf16x16_store(d + i, _mm512_loadu_ps(src + i));
#endif
        for (; i < n; i++) d[i] = float_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Sums over a vector run in LANES interleaved lanes, then pairwise (lane_sum). */
#define LANES 16

static inline float lane_sum(float acc[LANES]) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

#define MAX_DIM 1024  /* the widest attention head the layer operations take */

/* The int4/int8 kernels' prefetch (avx512_gemm.c, avx2_gemm.c, amx_gemm.c). A kernel's first
 * pass over a block of 32 outputs asks for the weights PREFETCH bytes ahead of those it reads:
 * the hardware's prefetchers alone left 2-6 rows compute-bound and memory-bound in turn (Zen 5,
 * weights streamed from memory: avx512_gemm.c at 4 rows 19-23 GB/s, 33-40 with it; one row 40
 * against 43-48; avx2_gemm.c 1.1-1.6x). 1-16 KB ahead measured alike. Prefetches never fault,
 * so reading past a buffer's end is harmless, and they change no result. */
#define PREFETCH 4096

static inline void ahead(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)p + PREFETCH + off);
}

/* The rows one pass over a block of weights serves, and ROWS_CASES(call): call(R) with that
 * pass's row count, r (1..ROWS, in scope), as the constant R, so each count compiles to its own
 * unrolled loops. Six: in avx2_gemm.c 12 int32 sums fill the registers (madd_acc). */
#define ROWS 6
#define ROWS_CASES(call)                                                                   \
    switch (r) {                                                                           \
        case 6: call(6); break; case 5: call(5); break; case 4: call(4); break;            \
        case 3: call(3); break; case 2: call(2); break; default: call(1);                  \
    }
#endif
