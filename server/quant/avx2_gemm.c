/* int4 and int8 weights times bf16 activations on AVX2 + FMA CPUs without AVX-512 BF16: the
 * same functions and layouts as avx512_gemm.c (cpu_gemm.py's pack_int4 / pack_int8), with fp32
 * FMAs instead of vdpbf16ps. int4: y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * scale[n, g] +
 * zero[n, g]); int8: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
 *
 * Per group it sums x * q in fp32 (q and x are exact in fp32, each product is exact) and adds
 * scale * that + (zero - 8 * scale) * sum_k x: the weights are never rounded. The nibbles of a
 * pair of inputs become fp32 once per call and serve every row of it (rows in blocks of ROWS);
 * x is converted to fp32 once per call, so each input is one broadcast load.
 *
 * A block of 32 outputs goes in two halves, each 16 bytes of every pair's 32: bytes 2i + h of
 * the half hold q[o, 2p + h] in the low nibble and q[o + 16, 2p + h] in the high one, for the
 * half's outputs o = 8 * half + i. As 8 uint16 lanes, lane i holds four nibbles: (o, 2p), (o + 16,
 * 2p), (o, 2p + 1), (o + 16, 2p + 1).
 *
 * Batch invariance: each row takes the same instructions in the same order whether it is
 * computed alone or among others; a row's accumulators never mix with another's. Returns
 * nonzero where it cannot (built without AVX2, FMA and F16C, or shapes it does not take).
 */
#include <stdint.h>
#include <string.h>

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define ROWS 4 /* 16 ymm registers: 8 accumulators, 4 weights, x, mask (5 or 6 spill) */
#define GROUP_HEAD 128 /* bytes of scales and zeros before a group's nibbles */

static inline int64_t group_bytes(int64_t group) { return GROUP_HEAD + group * 16; }

static inline __m256 half8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

#include <stdlib.h>

/* x bf16 [m, k] as fp32 (malloc'd; NULL if out of memory). */
static float *to_fp32(const uint16_t *x, int64_t m, int64_t k) {
    float *out = malloc((size_t)(m * k) * sizeof(float));
    if (out)
        for (int64_t i = 0; i < m * k; i++) out[i] = bf16_to_float(x[i]);
    return out;
}

static inline void store_bf16(uint16_t *dst, __m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int j = 0; j < 8; j++) dst[j] = float_to_bf16(f[j]);
}

/* Rows [0, r) against the half `hb` of one block (outputs 8hb..8hb+7 and 16+8hb..16+8hb+7). */
static inline void half_block(const float *x, int64_t k, const float *xsum, int64_t groups,
                              int64_t group, const uint8_t *blk, void *y, int64_t n,
                              const int r, const int hb, const int out_fp32) {
    __m256 ya[ROWS], yb[ROWS];
    for (int i = 0; i < r; i++) ya[i] = yb[i] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi32(0xF);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(group), *pk = head + GROUP_HEAD + hb * 16;
        __m256 aa[ROWS], ab[ROWS];
        for (int i = 0; i < r; i++) aa[i] = ab[i] = _mm256_setzero_ps();
        const int64_t p0 = g * group / 2;
        for (int64_t p = 0; p < group / 2; p++) {
            __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(pk + p * 32)));
            __m256 wa0 = _mm256_cvtepi32_ps(_mm256_and_si256(u, nibble));
            __m256 wb0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u, 4), nibble));
            __m256 wa1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u, 8), nibble));
            __m256 wb1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 12));
            for (int i = 0; i < r; i++) {
                const float *xp = x + i * k + 2 * (p0 + p);
                __m256 x0 = _mm256_broadcast_ss(xp), x1 = _mm256_broadcast_ss(xp + 1);
                aa[i] = _mm256_fmadd_ps(x1, wa1, _mm256_fmadd_ps(x0, wa0, aa[i]));
                ab[i] = _mm256_fmadd_ps(x1, wb1, _mm256_fmadd_ps(x0, wb0, ab[i]));
            }
        }
        const __m256 sa = half8(head + hb * 16), sb = half8(head + 32 + hb * 16);
        const __m256 m8 = _mm256_set1_ps(-8.0f);
        /* zero - 8 * scale: what each unit of sum_k x adds, q's offset folded in */
        const __m256 za = _mm256_add_ps(half8(head + 64 + hb * 16), _mm256_mul_ps(m8, sa));
        const __m256 zb = _mm256_add_ps(half8(head + 96 + hb * 16), _mm256_mul_ps(m8, sb));
        for (int i = 0; i < r; i++) {
            __m256 xs = _mm256_set1_ps(xsum[i * groups + g]);
            ya[i] = _mm256_add_ps(_mm256_add_ps(ya[i], _mm256_mul_ps(aa[i], sa)),
                                  _mm256_mul_ps(xs, za));
            yb[i] = _mm256_add_ps(_mm256_add_ps(yb[i], _mm256_mul_ps(ab[i], sb)),
                                  _mm256_mul_ps(xs, zb));
        }
    }
    for (int i = 0; i < r; i++) {
        if (out_fp32) {
            _mm256_storeu_ps((float *)y + i * n + 8 * hb, ya[i]);
            _mm256_storeu_ps((float *)y + i * n + 16 + 8 * hb, yb[i]);
        } else {
            store_bf16((uint16_t *)y + i * n + 8 * hb, ya[i]);
            store_bf16((uint16_t *)y + i * n + 16 + 8 * hb, yb[i]);
        }
    }
}

static inline void block(const float *x, int64_t k, const float *xsum, int64_t groups,
                         int64_t group, const uint8_t *blk, void *y, int64_t n, const int r,
                         const int out_fp32) {
    half_block(x, k, xsum, groups, group, blk, y, n, r, 0, out_fp32);
    half_block(x, k, xsum, groups, group, blk, y, n, r, 1, out_fp32);
}

/* xf: fp32 [m, k]; y: [m, n], bf16 or (out_fp32) fp32; xsum: fp32 [m * k / group] scratch. */
static void gemm4(const float *xf, const uint8_t *packed, void *y, float *xsum, int64_t m,
                  int64_t n, int64_t k, int64_t group, int out_fp32) {
    int64_t groups = k / group, blocks = n / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t j = g * group; j < (g + 1) * group; j++) s = s + xf[i * k + j];
            xsum[i * groups + g] = s;
        }
    #pragma omp parallel for schedule(static) if (blocks >= 4)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = packed + b * groups * group_bytes(group);
        for (int64_t i = 0; i < m; i += ROWS) {
            int r = m - i < ROWS ? (int)(m - i) : ROWS;
            const float *xi = xf + i * k;
            const float *xs = xsum + i * groups;
            char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
            /* Constant row counts and output types, so each compiles to its own loops. */
            if (out_fp32) {
                if (r == 4) block(xi, k, xs, groups, group, blk, yi, n, 4, 1);
                else if (r == 3) block(xi, k, xs, groups, group, blk, yi, n, 3, 1);
                else if (r == 2) block(xi, k, xs, groups, group, blk, yi, n, 2, 1);
                else block(xi, k, xs, groups, group, blk, yi, n, 1, 1);
            } else {
                if (r == 4) block(xi, k, xs, groups, group, blk, yi, n, 4, 0);
                else if (r == 3) block(xi, k, xs, groups, group, blk, yi, n, 3, 0);
                else if (r == 2) block(xi, k, xs, groups, group, blk, yi, n, 2, 0);
                else block(xi, k, xs, groups, group, blk, yi, n, 1, 0);
            }
        }
    }
}

/* x: bf16 [m, k]; y: bf16 [m, n]; xsum: fp32 [m * k / group] scratch (x's sums per group). */
int int4_gemm(const uint16_t *x, const uint8_t *packed, uint16_t *y, float *xsum, int64_t m,
              int64_t n, int64_t k, int64_t group) {
    if (n % 32 || k % group || group % 2) return 1;
    float *xf = to_fp32(x, m, k);
    if (!xf) return 1;
    gemm4(xf, packed, y, xsum, m, n, k, group, 0);
    free(xf);
    return 0;
}

/* fp32 in and out (the compute dtype of CPUs without fast bf16): x and y are never rounded. */
int int4_gemm_f32(const float *x, const uint8_t *packed, float *y, float *xsum, int64_t m,
                  int64_t n, int64_t k, int64_t group) {
    if (n % 32 || k % group || group % 2) return 1;
    gemm4(x, packed, y, xsum, m, n, k, group, 1);
    return 0;
}

/* The weight as bf16 [k][n] (transposed), rows [k0, k1): w = (q - 8) * scale + zero in fp32,
 * rounded to nearest even (avx512_gemm.c's, scalar). */
int int4_unpack_q4x32(const uint8_t *packed, uint16_t *out, int64_t n, int64_t k,
                      int64_t group, int64_t k0, int64_t k1) {
    if (n % 32 || k % group || k0 < 0 || k1 > k || k0 > k1 || k0 % 2 || k1 % 2) return 1;
    int64_t groups = k / group;
    #pragma omp parallel for schedule(static)
    for (int64_t c = k0; c < k1; c += 2) {
        int64_t g = c / group, p = (c % group) / 2;
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *head = packed + (b * groups + g) * group_bytes(group);
            const uint8_t *src = head + GROUP_HEAD + p * 32;
            float sc[32], zr[32];
            for (int j = 0; j < 32; j += 8) {
                _mm256_storeu_ps(sc + j, half8(head + 2 * j));
                _mm256_storeu_ps(zr + j, half8(head + 64 + 2 * j));
            }
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 16; i++) {
                    uint8_t byte = src[2 * i + h];
                    int64_t o = b * 32 + i;
                    float lo = (float)(byte & 15) - 8.0f, hi = (float)(byte >> 4) - 8.0f;
                    out[(c + h) * n + o] = float_to_bf16(lo * sc[i] + zr[i]);
                    out[(c + h) * n + o + 16] = float_to_bf16(hi * sc[i + 16] + zr[i + 16]);
                }
        }
    }
    return 0;
}

/* int8 (pack_int8): per block of 32 outputs and pair of inputs (2p, 2p + 1), 64 bytes: byte
 * 2i + h of the first 32 is q[32b + i, 2p + h], of the next 32 q[32b + 16 + i, 2p + h]. A
 * quarter (16 bytes) holds 8 outputs' pairs; as uint16 lanes, lane i = q[o, 2p] | q[o, 2p+1] << 8
 * (each signed). The block goes in halves of 16 outputs (32 bytes of each pair). */
static inline void half_block8(const float *x, int64_t k, const int8_t *blk,
                               const float *scale, void *y, int64_t n, const int r,
                               const int hb, int out_fp32) {
    __m256 a0[ROWS], a1[ROWS];
    for (int i = 0; i < r; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        const int8_t *src = blk + p * 64 + hb * 32;
        __m256i u0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
        __m256i u1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
        __m256 w00 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u0, 24), 24));
        __m256 w01 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u0, 16), 24));
        __m256 w10 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u1, 24), 24));
        __m256 w11 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u1, 16), 24));
        for (int i = 0; i < r; i++) {
            const float *xp = x + i * k + 2 * p;
            __m256 x0 = _mm256_broadcast_ss(xp), x1 = _mm256_broadcast_ss(xp + 1);
            a0[i] = _mm256_fmadd_ps(x1, w01, _mm256_fmadd_ps(x0, w00, a0[i]));
            a1[i] = _mm256_fmadd_ps(x1, w11, _mm256_fmadd_ps(x0, w10, a1[i]));
        }
    }
    const __m256 s0 = _mm256_loadu_ps(scale + 16 * hb), s1 = _mm256_loadu_ps(scale + 16 * hb + 8);
    for (int i = 0; i < r; i++) {
        __m256 v0 = _mm256_mul_ps(a0[i], s0), v1 = _mm256_mul_ps(a1[i], s1);
        if (out_fp32) {
            _mm256_storeu_ps((float *)y + i * n + 16 * hb, v0);
            _mm256_storeu_ps((float *)y + i * n + 16 * hb + 8, v1);
        } else {
            store_bf16((uint16_t *)y + i * n + 16 * hb, v0);
            store_bf16((uint16_t *)y + i * n + 16 * hb + 8, v1);
        }
    }
}

static inline void block8(const float *x, int64_t k, const int8_t *blk, const float *scale,
                          void *y, int64_t n, const int r, int out_fp32) {
    half_block8(x, k, blk, scale, y, n, r, 0, out_fp32);
    half_block8(x, k, blk, scale, y, n, r, 1, out_fp32);
}

static void gemm8(const float *xf, const int8_t *packed, const float *scale, void *y,
                  int64_t m, int64_t n, int64_t k, int out_fp32) {
    int64_t blocks = n / 32;
    #pragma omp parallel for schedule(static) if (blocks >= 4)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *blk = packed + b * k * 32;
        for (int64_t i = 0; i < m; i += ROWS) {
            int r = m - i < ROWS ? (int)(m - i) : ROWS;
            const float *xi = xf + i * k;
            char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
            if (r == 4) block8(xi, k, blk, scale + b * 32, yi, n, 4, out_fp32);
            else if (r == 3) block8(xi, k, blk, scale + b * 32, yi, n, 3, out_fp32);
            else if (r == 2) block8(xi, k, blk, scale + b * 32, yi, n, 2, out_fp32);
            else block8(xi, k, blk, scale + b * 32, yi, n, 1, out_fp32);
        }
    }
}

/* x: bf16 [m, k]; scale: fp32 [n]; y: [m, n], bf16 or (out_fp32: logits) fp32. */
int int8_gemm(const uint16_t *x, const int8_t *packed, const float *scale, void *y, int64_t m,
              int64_t n, int64_t k, int out_fp32) {
    if (n % 32 || k % 2) return 1;
    float *xf = to_fp32(x, m, k);
    if (!xf) return 1;
    gemm8(xf, packed, scale, y, m, n, k, out_fp32);
    free(xf);
    return 0;
}

/* fp32 in and out. */
int int8_gemm_f32(const float *x, const int8_t *packed, const float *scale, float *y,
                  int64_t m, int64_t n, int64_t k) {
    if (n % 32 || k % 2) return 1;
    gemm8(x, packed, scale, y, m, n, k, 1);
    return 0;
}

int avx2_gemm_available(void) { return 1; }

#else

int int4_gemm(const void *x, const void *packed, void *y, void *xsum, int64_t m, int64_t n,
              int64_t k, int64_t group) {
    return 1;
}

int int4_unpack_q4x32(const void *packed, void *out, int64_t n, int64_t k, int64_t group,
                      int64_t k0, int64_t k1) {
    return 1;
}

int int8_gemm(const void *x, const void *packed, const void *scale, void *y, int64_t m,
              int64_t n, int64_t k, int out_fp32) {
    return 1;
}

int int4_gemm_f32(const void *x, const void *packed, void *y, void *xsum, int64_t m,
                  int64_t n, int64_t k, int64_t group) {
    return 1;
}

int int8_gemm_f32(const void *x, const void *packed, const void *scale, void *y, int64_t m,
                  int64_t n, int64_t k) {
    return 1;
}

int avx2_gemm_available(void) { return 0; }

#endif
