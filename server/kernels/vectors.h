/* GCC vector extensions over VL floats for the layer operations' vector code (paged_attention.c,
 * dense_gemm.c): loads of fp32 or bf16 rows, fused multiply-adds where the CPU has them, lane
 * sums in one fixed tree. */
#ifndef LOCALSERVE_VECTORS_H
#define LOCALSERVE_VECTORS_H
#include <stdint.h>
#include <string.h>

/* VL floats in one vector: 16 on AVX-512 (one register), else 8 (one AVX2 register). GCC's
 * vector extensions, with fused multiply-adds where the CPU has them (vfma): a row's results
 * depend on this machine's build only, never on the rows beside it. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef float vf __attribute__((vector_size(64)));
static inline vf vfma(vf a, vf b, vf c) {
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
static inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef float vf __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) {
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
static inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#else
#define VL 8
typedef float vf __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif
typedef uint16_t u16v __attribute__((vector_size(2 * VL)));
typedef uint32_t u32v __attribute__((vector_size(4 * VL)));

typedef int32_t i32v __attribute__((vector_size(4 * VL)));

static inline vf vmax(vf a, vf b) {
    i32v take = a > b;
    return (vf)((take & (i32v)a) | (~take & (i32v)b));
}

/* e^x for x <= 0 in every lane (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n
 * by its exponent bits; within 2 ulp). n = round(x / ln2) by adding and subtracting 1.5 * 2^23
 * (exact for |x / ln2| < 2^22). Each lane's result depends on that lane only. */
static inline vf exp_negv(vf x) {
    const vf low = (vf){0} - 87.0f;
    i32v clamp = x < low;
    x = (vf)((clamp & (i32v)low) | (~clamp & (i32v)x));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * r * r + r + 1.0f;
    i32v bits = (__builtin_convertvector(n, i32v) + 127) << 23;
    return y * (vf)bits;
}

static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

static inline vf loadv(const char *p, int bf16) {
    vf f;
    if (bf16) {  /* a widening load and a shift: gcc splits __builtin_convertvector in five */
#if defined(__AVX512F__)
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        __m512i w = _mm512_slli_epi32(h, 16);
#elif defined(__AVX2__)
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        __m256i w = _mm256_slli_epi32(h, 16);
#else
        u16v h;
        memcpy(&h, p, sizeof h);
        u32v w = __builtin_convertvector(h, u32v) << 16;
#endif
        memcpy(&f, &w, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

/* The first `count` (1..VL) floats at src into a vector, zeros past them; and v's first `count`
 * lanes into dst. A whole vector is a fixed-size copy: a memcpy of a variable length is a
 * library call, which stalled the loops around it. */
static inline vf load_lanes(const float *src, int64_t count) {
    vf v = {0};
    if (count == VL)
        memcpy(&v, src, sizeof v);
    else
        memcpy(&v, src, (size_t)count * sizeof(float));
    return v;
}

static inline void store_lanes(float *dst, vf v, int64_t count) {
    if (count == VL)
        memcpy(dst, &v, sizeof v);
    else
        memcpy(dst, &v, (size_t)count * sizeof(float));
}

/* reduce2(a, b): the first half of the lanes the pairwise sums of a's lanes, the rest of b's. */
static inline vf reduce2(vf a, vf b) {
#if VL == 16
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* VL vectors -> one whose lane j is the sum of v[j]'s lanes (log2 VL rounds of reduce2). */
static inline vf sum_lanes(vf v[VL]) {
    for (int w = VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) v[i] = reduce2(v[2 * i], v[2 * i + 1]);
    return v[0];
}
#endif
