/* What avx512_gemm.c and amx_gemm.c share: the int4 layout's group heads, fp16 scales and bf16
 * stores, the per-group sums of x, the nibble lookup table, the int8 layout's pairs, and
 * avx512_gemm.c's entry points (amx_gemm.c falls back to them where its tiles do not take a
 * shape, or the process is refused AMX state; the AMX library is built from both sources). */
#ifndef LOCALSERVE_AVX512_GEMM_H
#define LOCALSERVE_AVX512_GEMM_H
#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AVX512_GEMM 1
#include <immintrin.h>

int avx512_int4_gemm(const uint16_t *x, const uint8_t *packed, uint16_t *y, float *xsum,
                     int64_t m, int64_t n, int64_t k, int64_t group, int64_t int8_from);
int avx512_int8_gemm(const uint16_t *x, const int8_t *packed, const float *scale, void *y,
                     int64_t m, int64_t n, int64_t k, int out_fp32);
int avx512_int4_unpack_q4x32(const uint8_t *packed, uint16_t *out, int64_t n, int64_t k,
                             int64_t group, int64_t k0, int64_t k1);
int avx512_gemm_a8(void);
int avx512_int4_gemm_a8(const uint16_t *x, const uint8_t *packed, uint16_t *y, int64_t m,
                        int64_t n, int64_t k, int64_t first);

#define GROUP_HEAD 128  /* bytes of scales and zeros before a group's nibbles */

static inline int64_t group_bytes(int64_t group) { return GROUP_HEAD + group * 16; }

static inline __m512 half16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* 16 fp32 to bf16, rounded to nearest even. */
static inline void store_bf16(uint16_t *dst, __m512 v) {
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
}

/* 16 bf16 -> fp32 (exact). */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* xsum[i * groups + g] = the sum of row i's inputs in group g: 16 lanes over the group, then
 * one fixed tree (a row's sums never depend on the other rows). */
static inline void group_sums(const uint16_t *x, float *xsum, int64_t m, int64_t k, int64_t group) {
    int64_t groups = k / group;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = x + i * k + g * group;
            if (group % 16 == 0) {
                __m512 v = load_bf16x16(xg);
                for (int64_t j = 16; j < group; j += 16)
                    v = _mm512_add_ps(v, load_bf16x16(xg + j));
                xsum[i * groups + g] = _mm512_reduce_add_ps(v);
                continue;
            }
            float s = 0.0f;
            for (int64_t j = 0; j < group; j++) s = s + bf16_to_float(xg[j]);
            xsum[i * groups + g] = s;
        }
}

/* Nibble v (either half of the index) -> q - 8 as bf16, for vpermw. */
static inline __m512i nibble_table(void) {
    uint16_t t[32];
    for (int v = 0; v < 32; v++) t[v] = float_to_bf16((float)(v & 15) - 8.0f);
    __m512i table;
    memcpy(&table, t, sizeof table);
    return table;
}

/* int8 (cpu_gemm.py's pack_int8): for each block of 32 outputs and each pair of inputs
 * (2p, 2p + 1), 64 bytes: byte 2i + h of the first 32 is q[32b + i, 2p + h], of the next 32
 * q[32b + 16 + i, 2p + h]. The int8 values become bf16 exactly (through fp32). */
static inline __m512i int8_pairs(const int8_t *p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Outputs [0, 32) of one row: fp32 (logits) or bf16. */
static inline void store_outputs(void *y, __m512 v0, __m512 v1, int out_fp32) {
    if (out_fp32) {
        _mm512_storeu_ps((float *)y, v0);
        _mm512_storeu_ps((float *)y + 16, v1);
    } else {
        store_bf16((uint16_t *)y, v0);
        store_bf16((uint16_t *)y + 16, v1);
    }
}

#else
#define AVX512_GEMM 0
int avx512_int4_unpack_q4x32(const void *packed, void *out, int64_t n, int64_t k,
                             int64_t group, int64_t k0, int64_t k1);
#endif
#endif
