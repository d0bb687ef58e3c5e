/* int4 and int8 weights times bf16 activations on AVX-512 BF16 (Zen 4/5, Intel Sapphire
 * Rapids on). int4: y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * scale[n, g] + zero[n, g]),
 * g = k / group; int8: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (int8_gemm, at the end).
 *
 * Per group it computes sum_k x * (1 + q / 16) with vdpbf16ps (1 + q / 16 is an exact bf16 whose
 * mantissa's top 4 bits are q: a shift and one vpternlog make it, shared by every row of the
 * call; products are exact in fp32) and adds 16 scale * that + (zero - 24 scale) * sum_k x: the
 * weights are never rounded. One row streams the weights at close to the memory's speed and
 * more rows reuse them from cache.
 *
 * Layout (cpu_gemm.py's pack_int4), one stream read front to back: for each block of 32 outputs,
 * for each group of inputs, the block's 32 scales and 32 zeros (fp16), then for each pair of
 * inputs (2p, 2p + 1) 32 bytes: byte 2i + h holds q[32b + i, 2p + h] in its low nibble and
 * q[32b + 16 + i, 2p + h] in its high nibble.
 *
 * Where the CPU has AVX-512 VNNI (Zen 4 and 5), the outputs from int4_gemm's int8_from on take
 * the activations as int8 per group of 32 instead (avx2_gemm.c's plain-AVX2 scheme, the same
 * bits; below): vpdpbusd sums 4 products a lane, so a group takes half the multiply-adds.
 *
 * Batch invariance: each row takes the same instructions in the same order whether it is
 * computed alone or among others (rows go in passes of up to 8 that share the weight unpacking,
 * but a row's accumulators never mix with another's). Returns nonzero where it cannot (built
 * without AVX-512 BF16, or shapes it does not take): the caller keeps PyTorch's kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"  /* ahead() */
#include "avx512_gemm.h"

#if AVX512_GEMM

/* Rows a pass: 8 (2 x 8 group sums and 2 x 8 running sums, the rest spilled once a group) beat
 * common.h's 6 here: Zen 5, 2 cores, cache-hot, 3072 x 576 at 32 / 128 rows 823 / 833 GFLOP/s
 * against 764 / 794 (4: 672 / 679; 10 or more: 410-470, the passes no longer unrolled). */
#define PASS 8
#define PASS_CASES(call)                                                                   \
    switch (r) {                                                                           \
        case 8: call(8); break; case 7: call(7); break; case 6: call(6); break;            \
        case 5: call(5); break; case 4: call(4); break; case 3: call(3); break;            \
        case 2: call(2); break; default: call(1);                                          \
    }


/* Rows [0, r) of x, inputs (2p, 2p + 1), against two vectors of 16 outputs' weight pairs. */
static inline void dp_rows(__m512 *a0, __m512 *a1, const uint16_t *x, int64_t k, int64_t p,
                           __m512i w0, __m512i w1, const int r) {
    for (int i = 0; i < r; i++) {
        int32_t xp;
        memcpy(&xp, x + i * k + 2 * p, sizeof xp);
        __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
        a0[i] = _mm512_dpbf16_ps(a0[i], xv, (__m512bh)w0);
        a1[i] = _mm512_dpbf16_ps(a1[i], xv, (__m512bh)w1);
    }
}

/* Rows [0, r) of x (r <= PASS) against one block of 32 outputs, into y (bf16, row stride n).
 * A nibble q becomes the bf16 1 + q / 16 (its 4 bits the top of the mantissa of 1.0: a shift
 * and one vpternlog, no table), so per group sum_k x * w = sum_k x (1 + q / 16) and the weight
 * (q - 8) * scale + zero is 16 scale * w + (zero - 24 scale): y += (16 scale) * that sum +
 * (zero - 24 scale) * sum_k x, the two per-block factors computed once per group for every row. */
static inline void block(const uint16_t *x, int64_t k, const float *xsum, int64_t groups,
                         int64_t group, const uint8_t *blk, uint16_t *y, int64_t n, const int r,
                         int prefetch) {
    __m512 y0[PASS], y1[PASS];
    for (int i = 0; i < r; i++) y0[i] = y1[i] = _mm512_setzero_ps();
    const __m512i one = _mm512_set1_epi16(0x3F80), mask = _mm512_set1_epi16(0x0078);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(group), *pk = head + GROUP_HEAD;
        if (prefetch) ahead(head, group_bytes(group));
        __m512 a0[PASS], a1[PASS];
        for (int i = 0; i < r; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        const int64_t p0 = g * group / 2;
        for (int64_t p = p0; p < p0 + group / 2; p++) {
            __m512i w = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256((const __m256i *)(pk + (p - p0) * 32)));
            /* (w << 3) & 0x78 | 0x3F80: the low nibble; (w >> 1) & 0x78 | 0x3F80: the high */
            __m512i w0 = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 3), mask, one, 0xEA);
            __m512i w1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 1), mask, one, 0xEA);
            dp_rows(a0, a1, x, k, p, w0, w1, r);
        }
        const __m512 s0 = half16(head), s1 = half16(head + 32);
        const __m512 sixteen = _mm512_set1_ps(16.0f), shift = _mm512_set1_ps(24.0f);
        const __m512 f0 = _mm512_mul_ps(s0, sixteen), f1 = _mm512_mul_ps(s1, sixteen);
        const __m512 z0 = _mm512_sub_ps(half16(head + 64), _mm512_mul_ps(s0, shift));
        const __m512 z1 = _mm512_sub_ps(half16(head + 96), _mm512_mul_ps(s1, shift));
        for (int i = 0; i < r; i++) {
            __m512 xs = _mm512_set1_ps(xsum[i * groups + g]);
            y0[i] = _mm512_fmadd_ps(xs, z0, _mm512_fmadd_ps(a0[i], f0, y0[i]));
            y1[i] = _mm512_fmadd_ps(xs, z1, _mm512_fmadd_ps(a1[i], f1, y1[i]));
        }
    }
    for (int i = 0; i < r; i++) {
        store_bf16(y + i * n, y0[i]);
        store_bf16(y + i * n + 16, y1[i]);
    }
}

#if defined(__AVX512VNNI__)
/* int8 activations (AVX-512 VNNI), for the outputs from int4_gemm's int8_from on, in groups of
 * 32 (cpu_gemm.int8_outputs_from: every layer but q/k/v by default, LOCALSERVE_ACTIVATIONS):
 * avx2_gemm.c's plain-AVX2 scheme, bit for bit (a test builds both), with vpdpbusd summing 4
 * nibbles times 4 int8 inputs a lane into exact int32: a group is 16 vpdpbusd a row where
 * vdpbf16ps took 32. Zen 5, cache-hot, 1.5-1.7x the bf16 path at 32-128 rows (3072 x 576 at
 * 32: 1,325 against 809 GFLOP/s; 8192 x 2048: 1,376 against 829), 1.3-2.1x at one row. */
#define A8_PATH 1
/* Rows a pass: 6 (4 sums a row, 24 registers, nothing spilled) beat 8 by 1.3x at 32 rows, and
 * 4, 5 or 7 by 2-5% (Zen 5, cache-hot). */
#define A8_PASS 6
#define A8_CASES(call)                                                                     \
    switch (r) {                                                                           \
        case 6: call(6); break; case 5: call(5); break; case 4: call(4); break;            \
        case 3: call(3); break; case 2: call(2); break; default: call(1);                  \
    }

/* Each row's inputs as int8 per group of 32: x ~ a * X with X = round(x * 127 / max |x|), and
 * a * sum(X) per (row, group) for the zeros (avx2_gemm.c's quantize8 on bf16 inputs, the same
 * numbers). A row's numbers are its own. */
static void quantize8(const uint16_t *x, int64_t m, int64_t k, int8_t *xq, float *xa,
                      float *xsum) {
    const int64_t groups = k / 32;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    #pragma omp parallel for schedule(static) if (m * k >= (1 << 14))
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = x + i * k + g * 32;
            const __m512 v0 = load_bf16x16(xg), v1 = load_bf16x16(xg + 16);
            const float peak = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
            const __m512 iv = _mm512_set1_ps(peak > 0.0f ? 127.0f / peak : 0.0f);
            /* round to nearest even, |X| <= 127 */
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
            _mm_storeu_si128((__m128i *)(xq + i * k + g * 32), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + i * k + g * 32 + 16), _mm512_cvtsepi32_epi8(q1));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            xa[i * groups + g] = peak / 127.0f;
            xsum[i * groups + g] = xa[i * groups + g] * (float)sum;
        }
}

/* block() with int8 inputs, groups of 32: a group's two pairs of inputs (64 bytes) interleave by
 * 16 bits (one vpermw) into 16 32-bit lanes, lane i output i's four inputs (low nibbles) and
 * output 16 + i's (high ones), which vpdpbusd takes against the row's four int8 inputs; per
 * group y += (a * scale) * sum + a * sum(X) * (zero - 8 * scale), as avx2_gemm.c rounds it. */
static inline void block_a8(const int8_t *xq, int64_t k, const float *xa, const float *xsum,
                            int64_t groups, const uint8_t *blk, uint16_t *y, int64_t n,
                            const int r, int prefetch) {
    __m512 y0[A8_PASS], y1[A8_PASS];
    for (int i = 0; i < r; i++) y0[i] = y1[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(32), *pk = head + GROUP_HEAD;
        if (prefetch) ahead(head, group_bytes(32));
        __m512i a0[A8_PASS], a1[A8_PASS];
        for (int i = 0; i < r; i++) a0[i] = a1[i] = _mm512_setzero_si512();
        const int8_t *x0 = xq + g * 32;
        for (int64_t c = 0; c < 8; c++) { /* inputs 4c .. 4c + 3 */
            const __m512i v = _mm512_permutexvar_epi16(
                pairs, _mm512_loadu_si512((const void *)(pk + c * 64)));
            const __m512i w0 = _mm512_and_si512(v, low);
            const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int i = 0; i < r; i++) {
                int32_t four;
                memcpy(&four, x0 + i * k + 4 * c, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                a0[i] = _mm512_dpbusd_epi32(a0[i], w0, xb);
                a1[i] = _mm512_dpbusd_epi32(a1[i], w1, xb);
            }
        }
        const __m512 s0 = half16(head), s1 = half16(head + 32), eight = _mm512_set1_ps(-8.0f);
        const __m512 z0 = _mm512_add_ps(half16(head + 64), _mm512_mul_ps(eight, s0));
        const __m512 z1 = _mm512_add_ps(half16(head + 96), _mm512_mul_ps(eight, s1));
        for (int i = 0; i < r; i++) {
            const __m512 xs = _mm512_set1_ps(xsum[i * groups + g]);
            const __m512 a = _mm512_set1_ps(xa[i * groups + g]);
            y0[i] = _mm512_fmadd_ps(xs, z0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]),
                                                            _mm512_mul_ps(a, s0), y0[i]));
            y1[i] = _mm512_fmadd_ps(xs, z1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]),
                                                            _mm512_mul_ps(a, s1), y1[i]));
        }
    }
    for (int i = 0; i < r; i++) {
        store_bf16(y + i * n, y0[i]);
        store_bf16(y + i * n + 16, y1[i]);
    }
}

/* The blocks of 32 outputs from `first` on with int8 inputs (groups of 32). Nonzero if out of
 * memory. */
static int gemm4_a8(const uint16_t *x, const uint8_t *packed, uint16_t *y, int64_t m, int64_t n,
                    int64_t k, int64_t first) {
    const int64_t groups = k / 32, blocks = n / 32, cells = m * groups;
    char *mem = malloc((size_t)(2 * cells) * sizeof(float) + (size_t)(m * k));
    if (!mem) return 1;
    float *xa = (float *)mem, *xsum = xa + cells;
    int8_t *xq = (int8_t *)(xsum + cells);
    quantize8(x, m, k, xq, xa, xsum);
    #pragma omp parallel for schedule(static) if (blocks - first >= 4)
    for (int64_t b = first; b < blocks; b++) {
        const uint8_t *blk = packed + b * groups * group_bytes(32);
        for (int64_t i = 0; i < m; i += A8_PASS) {
            int r = m - i < A8_PASS ? (int)(m - i) : A8_PASS;
#define A8(R) block_a8(xq + i * k, k, xa + i * groups, xsum + i * groups, groups, blk, \
                       y + i * n + b * 32, n, R, i == 0)
            A8_CASES(A8)
#undef A8
        }
    }
    free(mem);
    return 0;
}
#endif

/* x: bf16 [m, k]; y: bf16 [m, n]; xsum: fp32 [m * k / group] scratch (x's sums per group);
 * outputs int8_from.. (0..n, a multiple of 32; n: none) take int8 inputs where this build has
 * that path (avx512_gemm_a8) and groups are 32; elsewhere it changes nothing. */
int avx512_int4_gemm(const uint16_t *x, const uint8_t *packed, uint16_t *y, float *xsum,
                     int64_t m, int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    if (n % 32 || k % group || group % 2 || int8_from < 0 || int8_from > n || int8_from % 32)
        return 1;
    int64_t groups = k / group, blocks = n / 32;
#ifdef A8_PATH
    if (group == 32 && int8_from < n) {
        if (gemm4_a8(x, packed, y, m, n, k, int8_from / 32)) return 1;
        blocks = int8_from / 32;
        if (!blocks) return 0;
    }
#endif
    group_sums(x, xsum, m, k, group);
    #pragma omp parallel for schedule(static) if (blocks >= 4)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = packed + b * groups * group_bytes(group);
        for (int64_t i = 0; i < m; i += PASS) {
            int r = m - i < PASS ? (int)(m - i) : PASS;
            const uint16_t *xi = x + i * k;
            const float *xs = xsum + i * groups;
            uint16_t *yi = y + i * n + b * 32;
#define BLOCK(R) block(xi, k, xs, groups, group, blk, yi, n, R, i == 0)
            PASS_CASES(BLOCK)
#undef BLOCK
        }
    }
    return 0;
}

/* The weight as bf16 [k][n] (transposed, so that x @ out is the layer), rows [k0, k1):
 * w = (q - 8) * scale + zero in fp32, rounded to nearest even. For prompt rows (rows.py). */
int avx512_int4_unpack_q4x32(const uint8_t *packed, uint16_t *out, int64_t n, int64_t k,
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
            _mm512_storeu_ps(sc, half16(head));
            _mm512_storeu_ps(sc + 16, half16(head + 32));
            _mm512_storeu_ps(zr, half16(head + 64));
            _mm512_storeu_ps(zr + 16, half16(head + 96));
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

static inline void block8(const uint16_t *x, int64_t k, const int8_t *blk, const float *scale,
                          void *y, int64_t n, const int r, int out_fp32, int prefetch) {
    __m512 a0[PASS], a1[PASS];
    for (int i = 0; i < r; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        if (prefetch) ahead(blk + p * 64, 64);
        dp_rows(a0, a1, x, k, p, int8_pairs(blk + p * 64), int8_pairs(blk + p * 64 + 32), r);
    }
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    for (int i = 0; i < r; i++) {
        char *row = (char *)y + i * n * (out_fp32 ? 4 : 2);
        store_outputs(row, _mm512_mul_ps(a0[i], s0), _mm512_mul_ps(a1[i], s1), out_fp32);
    }
}

/* x: bf16 [m, k]; scale: fp32 [n]; y: [m, n], bf16 or (out_fp32: logits) fp32. */
int avx512_int8_gemm(const uint16_t *x, const int8_t *packed, const float *scale, void *y,
                     int64_t m, int64_t n, int64_t k, int out_fp32) {
    if (n % 32 || k % 2) return 1;
    int64_t blocks = n / 32;
    #pragma omp parallel for schedule(static) if (blocks >= 4)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *blk = packed + b * k * 32;
        for (int64_t i = 0; i < m; i += PASS) {
            int r = m - i < PASS ? (int)(m - i) : PASS;
            const uint16_t *xi = x + i * k;
            char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
#define BLOCK8(R) block8(xi, k, blk, scale + b * 32, yi, n, R, out_fp32, i == 0)
            PASS_CASES(BLOCK8)
#undef BLOCK8
        }
    }
    return 0;
}

int avx512_gemm_available(void) { return 1; }

/* 1 where this build has the int8-activation path int4_gemm's int8_from asks for, else 0. */
#ifdef A8_PATH
int avx512_gemm_a8(void) { return 1; }

/* The int8-activation outputs alone, blocks of 32 from `first` on (amx_gemm.c's int4_gemm:
 * its tiles take the outputs before). */
int avx512_int4_gemm_a8(const uint16_t *x, const uint8_t *packed, uint16_t *y, int64_t m,
                        int64_t n, int64_t k, int64_t first) {
    return gemm4_a8(x, packed, y, m, n, k, first);
}
#else
int avx512_gemm_a8(void) { return 0; }

int avx512_int4_gemm_a8(const uint16_t *x, const uint8_t *packed, uint16_t *y, int64_t m,
                        int64_t n, int64_t k, int64_t first) {
    return 1;
}
#endif

#else

int avx512_int4_gemm(const void *x, const void *packed, void *y, void *xsum, int64_t m,
                     int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    return 1;
}

int avx512_int4_unpack_q4x32(const void *packed, void *out, int64_t n, int64_t k,
                             int64_t group, int64_t k0, int64_t k1) {
    return 1;
}

int avx512_int8_gemm(const void *x, const void *packed, const void *scale, void *y, int64_t m,
                     int64_t n, int64_t k, int out_fp32) {
    return 1;
}

int avx512_gemm_available(void) { return 0; }

int avx512_gemm_a8(void) { return 0; }

#endif
