/* int4 and int8 weights times bf16 or fp32 activations on AVX2 + FMA CPUs without AVX-512 BF16
 * and Intel ones without AMX (cpu_gemm.kinds_for):
 * the same functions and layouts as avx512_gemm.c (cpu_gemm.py's pack_int4 / pack_int8).
 * int4: y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * scale[n, g] + zero[n, g]); int8:
 * y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
 *
 * int4: each row's activations become int16 per group (x ~ a * X, quantize16: error at most
 * 2^-16 of the group's largest, where bf16 rounds every value to 2^-9 of itself), and vpmaddwd
 * multiplies 16 of them by 16 nibbles at once into exact int32 sums; per group the output adds
 * scale * a * that + (zero - 8 * scale) * sum_k x, with x's exact fp32 sum: the weights are never
 * rounded. On Zen 4 held to AVX2 this took 1.4x fewer cycles than fp32 FMAs on the unpacked
 * nibbles, at one row and at 32. The weights of a block serve ROWS rows per pass: without VNNI
 * every vpmaddwd needs a vpaddd, and the two are the inner loop.
 *
 * A block of 32 outputs goes in two halves, each 16 bytes of every pair's 32: bytes 2i + h of
 * the half hold q[o, 2p + h] in the low nibble and q[o + 16, 2p + h] in the high one, for the
 * half's outputs o = 8 * half + i.
 *
 * int8 (the LM head): the same with int8 weights, x in int16 per group of 32 inputs.
 *
 * Plain AVX2 (no VNNI path below) can take int8 activations for int4 layers of groups of 32
 * instead, for the outputs from int4_gemm_f32's int8_from on (cpu_gemm.py asks it for every
 * layer but q/k/v there by default, LOCALSERVE_ACTIVATIONS): vpmaddubsw multiplies 32 nibbles
 * by 32 int8 inputs at once into int16 sums, which a group of 32 cannot overflow, so a group
 * needs half the vector instructions of vpmaddwd + vpaddd. 1.4-1.5x the int16 kernel's speed
 * at 32-512 rows, 1.2x at one, for activations rounded to 1/254 of the group's largest (what
 * it costs: docs/architecture.md). Rows stay independent.
 *
 * Where the compiler targets AVX-512 VNNI (-march=native on such a CPU), the int32 sums come
 * from vpdpwssd on whole blocks instead (WIDE_ROWS, below): the same bits, 1.3-2.5x faster.
 * Where it targets AVX-VNNI but not AVX-512, from VEX vpdpwssd on the AVX2 path's halves
 * (madd_acc): the same bits again.
 *
 * Batch invariance: each row takes the same instructions in the same order whether it is
 * computed alone or among others; a row's accumulators never mix with another's. Returns
 * nonzero where it cannot (built without AVX2, FMA and F16C, or shapes it does not take).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"  /* bf16, ROWS_CASES, ahead() */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define GROUP_HEAD 128 /* bytes of scales and zeros before a group's nibbles */

static inline int64_t group_bytes(int64_t group) { return GROUP_HEAD + group * 16; }

static inline __m256 half8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* A group's fp32 steps on its int32 sums, written once for 8 lanes (V = _mm256) and 16 (_mm512)
 * so that both paths round alike: zero - 8 * scale (what each unit of sum_k x adds, q's offset
 * folded in), then y + sum * (a * scale) + sum_k x * that. */
#define ZERO_OFFSET(V, zero, s) V##_add_ps(zero, V##_mul_ps(V##_set1_ps(-8.0f), s))
#define GROUP_STEP(V, y, sum, a, s, xs, z) \
    V##_fmadd_ps(xs, z, V##_fmadd_ps(V##_cvtepi32_ps(sum), V##_mul_ps(a, s), y))
/* int8: y + sum * a per group of inputs (the row scales multiply once at the end). */
#define INT8_STEP(V, y, sum, a) V##_fmadd_ps(V##_cvtepi32_ps(sum), a, y)

/* acc + vpmaddwd(w, x) in acc's own register: from the intrinsics gcc moves every sum to a new
 * register each step and spills them from 4 rows on. Exact either way: only speed differs.
 * Where the compiler targets AVX-VNNI without AVX-512 (Intel from Alder Lake and the Xeon 6
 * E-cores on), one VEX vpdpwssd does both: the same int32 sums in half the instructions. */
#if defined(__AVXVNNI__) && !(defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define VEX_VNNI 1
static inline __m256i madd_acc(__m256i acc, __m256i w, __m256i x) {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
    return acc;
}
#else
static inline __m256i madd_acc(__m256i acc, __m256i w, __m256i x) {
    __m256i t;
    __asm__("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(w), "x"(x));
    return acc;
}
#endif

/* Input pair p's weights for a half block: 8 outputs' pairs each in w0 and w1 (int16 lanes);
 * int4: w0 the low nibbles, w1 16 x the high ones. */
static inline __attribute__((always_inline)) void half_pair(const uint8_t *w, int64_t p,
                                                           const int int8, __m256i low,
                                                           __m256i *w0, __m256i *w1) {
    if (int8) {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + p * 64)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + p * 64 + 16)));
    } else {
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + p * 32)));
        *w0 = _mm256_and_si256(v, low);
        /* 16 x the high nibble: an AND (any vector port), where a shift took one of the two
         * that vpmaddwd and vpdpwssd need; half_block scales its sums back exactly */
        *w1 = _mm256_and_si256(v, _mm256_slli_epi16(low, 4));
    }
}

/* The int32 sums of rows [0, r) over `pairs` pairs of inputs from x0 (row stride k) against
 * two vectors of 8 outputs' weight pairs each: int4 (nibbles, 32 bytes a pair, the half's 16
 * at w) or int8 (64 bytes a pair, the half's 32 at w). Named sums, since gcc keeps arrays of
 * them in memory; r is a constant in every caller. With AVX-VNNI, up to 3 rows, odd pairs go
 * to a second set of sums (a3-a5, b3-b5), added at the end: each vpdpwssd waits for the last
 * on its sum (vpmaddwd + vpaddd wait only for the add), which left few rows latency-bound;
 * int32 sums in any order are the same. */
static inline void pair_sums(const int16_t *x0, int64_t k, int64_t pairs, const uint8_t *w,
                             const int int8, const int r, __m256i *sa, __m256i *sb) {
    const __m256i low = _mm256_set1_epi16(0xF);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
#ifdef VEX_VNNI
    const int split = r <= 3;
#else
    const int split = 0;
#endif
    int64_t p = 0;
    __m256i w0, w1;
#define ROW(i, j, P)                                                      \
        if (r > i) {                                                      \
            int32_t pair;                                                 \
            memcpy(&pair, x0 + i * k + 2 * (P), sizeof pair);             \
            const __m256i xp = _mm256_set1_epi32(pair);                   \
            a##j = madd_acc(a##j, w0, xp);                                \
            b##j = madd_acc(b##j, w1, xp);                                \
        }
    if (split)
        for (; p + 1 < pairs; p += 2) {
            half_pair(w, p, int8, low, &w0, &w1);
            ROW(0, 0, p) ROW(1, 1, p) ROW(2, 2, p)
            half_pair(w, p + 1, int8, low, &w0, &w1);
            ROW(0, 3, p + 1) ROW(1, 4, p + 1) ROW(2, 5, p + 1)
        }
    for (; p < pairs; p++) {
        half_pair(w, p, int8, low, &w0, &w1);
        ROW(0, 0, p) ROW(1, 1, p) ROW(2, 2, p) ROW(3, 3, p) ROW(4, 4, p) ROW(5, 5, p)
    }
#undef ROW
    const __m256i as[ROWS] = {a0, a1, a2, a3, a4, a5}, bs[ROWS] = {b0, b1, b2, b3, b4, b5};
    for (int i = 0; i < r; i++) {
        sa[i] = split ? _mm256_add_epi32(as[i], as[i + 3]) : as[i];
        sb[i] = split ? _mm256_add_epi32(bs[i], bs[i + 3]) : bs[i];
    }
}

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

/* Each row's inputs as int16 per group: x ~ a * X with X = round(x * 32767 / max |x|) (error at
 * most 2^-16 of the group's largest, ~100x finer than bf16's rounding), a per (row, group), and
 * the exact fp32 sum of x per (row, group) for the zeros. A row's numbers are its own. */
static void quantize16(const float *x, int64_t m, int64_t k, int64_t group, int16_t *xq,
                       float *xa, float *xsum) {
    int64_t groups = k / group;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    #pragma omp parallel for schedule(static) if (m * k >= (1 << 14))
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + i * k + g * group;
            int16_t *out = xq + i * k + g * group;
            /* 8 lanes of maxima and sums, then across them in a fixed order */
            __m256 pv = _mm256_setzero_ps(), sv = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= group; j += 8) {
                __m256 v = _mm256_loadu_ps(xg + j);
                pv = _mm256_max_ps(pv, _mm256_andnot_ps(sign, v));
                sv = _mm256_add_ps(sv, v);
            }
            float pl[8], sl[8], peak = 0.0f, sum = 0.0f;
            _mm256_storeu_ps(pl, pv);
            _mm256_storeu_ps(sl, sv);
            for (int l = 0; l < 8; l++) {
                peak = pl[l] > peak ? pl[l] : peak;
                sum = sum + sl[l];
            }
            for (int64_t t = j; t < group; t++) {
                float v = fabsf(xg[t]);
                peak = v > peak ? v : peak;
                sum = sum + xg[t];
            }
            float inv = peak > 0.0f ? 32767.0f / peak : 0.0f;
            const __m256 iv = _mm256_set1_ps(inv);
            /* round to nearest even; packs saturates to [-32768, 32767] */
            for (j = 0; j + 8 <= group; j += 8) {
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + j), iv));
                _mm_storeu_si128((__m128i *)(out + j),
                                 _mm_packs_epi32(_mm256_castsi256_si128(q),
                                                 _mm256_extracti128_si256(q, 1)));
            }
            for (; j < group; j++) {
                float v = nearbyintf(xg[j] * inv);
                out[j] = (int16_t)(v > 32767.0f ? 32767.0f : (v < -32768.0f ? -32768.0f : v));
            }
            xa[i * groups + g] = peak / 32767.0f;
            xsum[i * groups + g] = sum;
        }
}

/* x's int16 form in one allocation (free it): X [m * k], then a and the sums [m * k / group]
 * each (k is even, so the floats are aligned). NULL if out of memory. */
typedef struct {
    int16_t *q;
    float *a, *sum;
} rows16;

static void *quantize_rows(const float *x, int64_t m, int64_t k, int64_t group, rows16 *r) {
    int64_t cells = m * (k / group);
    char *block = malloc((size_t)(m * k) * sizeof(int16_t) + (size_t)(2 * cells) * sizeof(float));
    if (!block) return NULL;
    r->q = (int16_t *)block;
    r->a = (float *)(block + (size_t)(m * k) * sizeof(int16_t));
    r->sum = r->a + cells;
    quantize16(x, m, k, group, r->q, r->a, r->sum);
    return block;
}

/* A group's fp16 scales of half `hb` (outputs 8hb.. in sa, 16+8hb.. in sb) and its zeros as
 * ZERO_OFFSET makes them (za, zb), from the group's head. */
static inline void half_scales(const uint8_t *head, const int hb, __m256 *sa, __m256 *sb,
                               __m256 *za, __m256 *zb) {
    *sa = half8(head + hb * 16);
    *sb = half8(head + 32 + hb * 16);
    *za = ZERO_OFFSET(_mm256, half8(head + 64 + hb * 16), *sa);
    *zb = ZERO_OFFSET(_mm256, half8(head + 96 + hb * 16), *sb);
}

/* Rows [0, r)'s outputs of half `hb` (8hb..8hb+7 from yacc[i], 16+8hb.. from yacc[i] + 8) into
 * y: fp32, or bf16 rounded as store_bf16 does. */
static inline void store_half(float yacc[][16], void *y, int64_t n, const int r, const int hb,
                              const int out_fp32) {
    for (int i = 0; i < r; i++) {
        __m256 ya = _mm256_load_ps(yacc[i]), yb = _mm256_load_ps(yacc[i] + 8);
        if (out_fp32) {
            _mm256_storeu_ps((float *)y + i * n + 8 * hb, ya);
            _mm256_storeu_ps((float *)y + i * n + 16 + 8 * hb, yb);
        } else {
            store_bf16((uint16_t *)y + i * n + 8 * hb, ya);
            store_bf16((uint16_t *)y + i * n + 16 + 8 * hb, yb);
        }
    }
}

/* Rows [0, r) against the half `hb` of one block (outputs 8hb..8hb+7 and 16+8hb..16+8hb+7).
 * Per pair of inputs the half's 16 bytes widen to 16 int16 lanes: lane 2i + h is byte 2i + h,
 * q[o, 2p + h] in its low nibble and q[o + 16, 2p + h] in its high one (o = 8hb + i), so the
 * low nibbles are, per 32-bit lane i, output o's two weights, which vpmaddwd multiplies by the
 * pair (X[2p], X[2p + 1]) and adds: exact int32 sums per group (at most 2^20 per pair). */
static inline void half_block(const int16_t *xq, int64_t k, const float *xa,
                              const float *xsum, int64_t groups, int64_t group,
                              const uint8_t *blk, void *y, int64_t n, const int r,
                              const int hb, const int out_fp32, int prefetch) {
    /* the running outputs stay in memory: the int32 sums take the registers */
    float yacc[ROWS][16] __attribute__((aligned(32))) = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(group), *pk = head + GROUP_HEAD + hb * 16;
        if (prefetch) ahead(head, group_bytes(group));
        __m256i aa[ROWS], ab[ROWS];
        pair_sums(xq + g * group, k, group / 2, pk, 0, r, aa, ab);
        __m256 sa, sb, za, zb;
        half_scales(head, hb, &sa, &sb, &za, &zb);
        /* ab holds 16 x the sums (half_pair): below 2^31 at groups of 256 (16 x 15 x 32767 x
         * 256), and in fp32 16 x a sum rounds as the sum does. (16 * sum) * (a * (scale / 16))
         * is then the same real product as sum * (a * scale) (powers of 2 scale exactly) and
         * the FMA rounds it once: the same bits as the AVX-512 path's. */
        const __m256 sb16 = _mm256_mul_ps(sb, _mm256_set1_ps(0.0625f));
        for (int i = 0; i < r; i++) {
            __m256 xs = _mm256_set1_ps(xsum[i * groups + g]);
            __m256 a = _mm256_set1_ps(xa[i * groups + g]);
            _mm256_store_ps(yacc[i], GROUP_STEP(_mm256, _mm256_load_ps(yacc[i]), aa[i], a, sa,
                                                xs, za));
            _mm256_store_ps(yacc[i] + 8, GROUP_STEP(_mm256, _mm256_load_ps(yacc[i] + 8), ab[i], a,
                                                    sb16, xs, zb));
        }
    }
    store_half(yacc, y, n, r, hb, out_fp32);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* AVX-512 VNNI (Intel Xeons from Cascade Lake on, AMD Zen 4 and 5; compiled where the CPU has
 * it): vpdpwssd is vpmaddwd and its vpaddd in one instruction, on 16 lanes, so a pass takes a
 * whole block of 32 outputs (both halves' bytes widen to one vector) for WIDE_ROWS rows, the
 * 24 int32 sums in 24 of the 32 registers. The same exact int32 sums and, lane for lane, the
 * same fp32 arithmetic on them: bit for bit the AVX2 path's results (a test builds both). */
#define WIDE_ROWS 12
#define WIDE_CASES(call)                                                                   \
    switch (r) {                                                                           \
        case 12: call(12); break; case 11: call(11); break; case 10: call(10); break;      \
        case 9: call(9); break; case 8: call(8); break; case 7: call(7); break;            \
        case 6: call(6); break; case 5: call(5); break; case 4: call(4); break;            \
        case 3: call(3); break; case 2: call(2); break; default: call(1);                  \
    }

/* Input pair p's weights for the whole block: outputs 0-15 (w0) and 16-31 (w1). int4: the
 * pair's 32 bytes widen to 32 int16 lanes, 32-bit lane j = output j (low nibbles) and j + 16
 * (high ones); int8: the pair's first 32 bytes are outputs 0-15, the next 32 outputs 16-31. */
static inline __attribute__((always_inline)) void wide_pair(const uint8_t *w, int64_t p,
                                                           const int int8, __m512i *w0,
                                                           __m512i *w1) {
    if (int8) {
        *w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + p * 64)));
        *w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + p * 64 + 32)));
    } else {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + p * 32)));
        *w0 = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
        *w1 = _mm512_srli_epi16(v, 4);
    }
}

#define WIDE_INLINE static inline __attribute__((always_inline)) /* a copy per row count */

/* acc + vpdpwssd(w, x) in acc's own register (as madd_acc: from the intrinsic gcc copied every
 * sum to a new register and to the stack each step: 150 GMAC/s instead of 210-236). */
static inline __m512i dp_acc(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* pair_sums for a whole block: outputs 0-15 (sa) and 16-31 (sb). Up to 6 rows, odd pairs go
 * to a second set of sums (c, d), added at the end: each vpdpwssd waits for the last on its
 * sum, so one set left one row latency-bound (1.4x fewer GMAC/s at one row, in cache); int32
 * sums in any order are the same. */
WIDE_INLINE void wide_sums(const int16_t *x0, int64_t k, int64_t pairs, const uint8_t *w,
                           const int int8, const int r, __m512i *sa, __m512i *sb) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    __m512i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0,
            b9 = a0, b10 = a0, b11 = a0;
    __m512i c0 = a0, c1 = a0, c2 = a0, c3 = a0, c4 = a0, c5 = a0;
    __m512i d0 = a0, d1 = a0, d2 = a0, d3 = a0, d4 = a0, d5 = a0;
    const int split = r <= 6;
    int64_t p = 0;
#define ROW(i, A, B, P)                                                   \
        if (r > i) {                                                      \
            int32_t pair;                                                 \
            memcpy(&pair, x0 + i * k + 2 * (P), sizeof pair);             \
            const __m512i xp = _mm512_set1_epi32(pair);                   \
            A##i = dp_acc(A##i, w0, xp);                                  \
            B##i = dp_acc(B##i, w1, xp);                                  \
        }
    if (split)
        for (; p + 1 < pairs; p += 2) {
            __m512i w0, w1;
            wide_pair(w, p, int8, &w0, &w1);
            ROW(0, a, b, p) ROW(1, a, b, p) ROW(2, a, b, p)
            ROW(3, a, b, p) ROW(4, a, b, p) ROW(5, a, b, p)
            wide_pair(w, p + 1, int8, &w0, &w1);
            ROW(0, c, d, p + 1) ROW(1, c, d, p + 1) ROW(2, c, d, p + 1)
            ROW(3, c, d, p + 1) ROW(4, c, d, p + 1) ROW(5, c, d, p + 1)
        }
    for (; p < pairs; p++) {
        __m512i w0, w1;
        wide_pair(w, p, int8, &w0, &w1);
        ROW(0, a, b, p) ROW(1, a, b, p) ROW(2, a, b, p) ROW(3, a, b, p)
        ROW(4, a, b, p) ROW(5, a, b, p) ROW(6, a, b, p) ROW(7, a, b, p)
        ROW(8, a, b, p) ROW(9, a, b, p) ROW(10, a, b, p) ROW(11, a, b, p)
    }
#undef ROW
    const __m512i as[WIDE_ROWS] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    const __m512i bs[WIDE_ROWS] = {b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11};
    const __m512i cs[6] = {c0, c1, c2, c3, c4, c5}, ds[6] = {d0, d1, d2, d3, d4, d5};
    for (int i = 0; i < r; i++) {
        sa[i] = split ? _mm512_add_epi32(as[i], cs[i]) : as[i];
        sb[i] = split ? _mm512_add_epi32(bs[i], ds[i]) : bs[i];
    }
}

static inline __m512 half16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Row i's 32 outputs from yacc[i] into y (fp32, or bf16 rounded as store_bf16 does). */
static inline void wide_store(float yacc[][32], void *y, int64_t n, const int r,
                              const int out_fp32) {
    for (int i = 0; i < r; i++) {
        if (out_fp32)
            memcpy((float *)y + i * n, yacc[i], 32 * sizeof(float));
        else
            for (int j = 0; j < 32; j++) ((uint16_t *)y)[i * n + j] = float_to_bf16(yacc[i][j]);
    }
}

/* half_block's arithmetic for both halves at once. */
WIDE_INLINE void wide_block(const int16_t *xq, int64_t k, const float *xa, const float *xsum,
                            int64_t groups, int64_t group, const uint8_t *blk, void *y,
                            int64_t n, const int r, const int out_fp32, int prefetch) {
    float yacc[WIDE_ROWS][32] __attribute__((aligned(64))) = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(group);
        if (prefetch) ahead(head, group_bytes(group));
        __m512i aa[WIDE_ROWS], ab[WIDE_ROWS];
        wide_sums(xq + g * group, k, group / 2, head + GROUP_HEAD, 0, r, aa, ab);
        const __m512 sa = half16(head), sb = half16(head + 32);
        const __m512 za = ZERO_OFFSET(_mm512, half16(head + 64), sa);
        const __m512 zb = ZERO_OFFSET(_mm512, half16(head + 96), sb);
        for (int i = 0; i < r; i++) {
            __m512 xs = _mm512_set1_ps(xsum[i * groups + g]);
            __m512 a = _mm512_set1_ps(xa[i * groups + g]);
            _mm512_store_ps(yacc[i], GROUP_STEP(_mm512, _mm512_load_ps(yacc[i]), aa[i], a, sa,
                                                xs, za));
            _mm512_store_ps(yacc[i] + 16, GROUP_STEP(_mm512, _mm512_load_ps(yacc[i] + 16), ab[i],
                                                     a, sb, xs, zb));
        }
    }
    wide_store(yacc, y, n, r, out_fp32);
}

/* half_block8's arithmetic for both halves at once. */
WIDE_INLINE void wide_block8(const int16_t *xq, int64_t k, const float *xa, int64_t xg,
                             const int8_t *blk, const float *scale, void *y, int64_t n,
                             const int r, int out_fp32, int prefetch) {
    float yacc[WIDE_ROWS][32] __attribute__((aligned(64))) = {{0}};
    int64_t groups = k / xg;
    for (int64_t g = 0; g < groups; g++) {
        __m512i a0[WIDE_ROWS], a1[WIDE_ROWS];
        if (prefetch) ahead(blk + g * xg * 32, xg * 32);
        wide_sums(xq + g * xg, k, xg / 2, (const uint8_t *)blk + g * xg * 32, 1, r, a0, a1);
        for (int i = 0; i < r; i++) {
            __m512 a = _mm512_set1_ps(xa[i * groups + g]);
            _mm512_store_ps(yacc[i], INT8_STEP(_mm512, _mm512_load_ps(yacc[i]), a0[i], a));
            _mm512_store_ps(yacc[i] + 16, INT8_STEP(_mm512, _mm512_load_ps(yacc[i] + 16), a1[i],
                                                    a));
        }
    }
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    for (int i = 0; i < r; i++) {
        _mm512_store_ps(yacc[i], _mm512_mul_ps(_mm512_load_ps(yacc[i]), s0));
        _mm512_store_ps(yacc[i] + 16, _mm512_mul_ps(_mm512_load_ps(yacc[i] + 16), s1));
    }
    wide_store(yacc, y, n, r, out_fp32);
}
#endif

/* One pass of r rows over a block of 32 outputs: int4 (pass4) and int8 (pass8, before gemm8),
 * on the path this build has, PASS_ROWS rows at most. */
#ifdef WIDE_ROWS
#define PASS_ROWS WIDE_ROWS
#define PASS_CASES WIDE_CASES
#define pass4 wide_block
#define pass8 wide_block8
#else
#define PASS_ROWS ROWS
#define PASS_CASES ROWS_CASES
static inline __attribute__((always_inline)) void pass4(
        const int16_t *xq, int64_t k, const float *xa, const float *xsum, int64_t groups,
        int64_t group, const uint8_t *blk, void *y, int64_t n, const int r, const int out_fp32,
        int prefetch) {
    for (int hb = 0; hb < 2; hb++)
        half_block(xq, k, xa, xsum, groups, group, blk, y, n, r, hb, out_fp32, prefetch && !hb);
}
#endif

#if !defined(WIDE_ROWS) && !defined(VEX_VNNI)
#define A8_PATH 1

/* acc + vpmaddubsw(w, x) in acc's own register, int16 lanes (as madd_acc). */
static inline __m256i maddubs_acc(__m256i acc, __m256i w, __m256i x) {
    __m256i t;
    __asm__("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(w), "x"(x));
    return acc;
}

/* Each row's inputs as int8 per group of 32: x ~ a * X with X = round(x * 127 / max |x|), and
 * a * sum(X) per (row, group) for the zeros: the rounded inputs' sum, as the weights meet them
 * (x's exact sum against q's 0..15 offset gave 4x the KL). A row's numbers are its own. */
static void quantize8(const float *x, int64_t m, int64_t k, int8_t *xq, float *xa,
                      float *xsum) {
    const int64_t groups = k / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    #pragma omp parallel for schedule(static) if (m * k >= (1 << 14))
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + i * k + g * 32;
            __m256 pv = _mm256_setzero_ps();
            for (int j = 0; j < 32; j += 8)
                pv = _mm256_max_ps(pv, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + j)));
            float pl[8], peak = 0.0f;
            _mm256_storeu_ps(pl, pv);
            for (int l = 0; l < 8; l++) peak = pl[l] > peak ? pl[l] : peak;
            const __m256 iv = _mm256_set1_ps(peak > 0.0f ? 127.0f / peak : 0.0f);
            __m256i sv = _mm256_setzero_si256();
            for (int j = 0; j < 32; j += 8) { /* round to nearest even, |X| <= 127 */
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + j), iv));
                sv = _mm256_add_epi32(sv, q);
                __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(q),
                                            _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i *)(xq + i * k + g * 32 + j), _mm_packs_epi16(h, h));
            }
            int32_t sl[8], sum = 0;
            _mm256_storeu_si256((__m256i *)sl, sv);
            for (int l = 0; l < 8; l++) sum += sl[l];
            xa[i * groups + g] = peak / 127.0f;
            xsum[i * groups + g] = xa[i * groups + g] * (float)sum;
        }
}

/* half_block with int8 inputs, groups of 32. Two pairs' 16 bytes interleave by 16 bits into 8
 * 32-bit lanes, lane i output 8hb + i's four inputs (low nibbles) and output 16 + 8hb + i's
 * (high ones); vpmaddubsw takes them against the row's four int8 inputs (broadcast) into two
 * int16 sums a lane, at most 8 x 2 x 15 x 127 over the group, and vpmaddwd by ones makes them
 * that output's int32 sum; then half_block's fp32 steps, q's offset with the rounded sum. */
static inline void half_block_a8(const int8_t *xq, int64_t k, const float *xa,
                                 const float *xsum, int64_t groups, const uint8_t *blk,
                                 void *y, int64_t n, const int r, const int hb,
                                 const int out_fp32, int prefetch) {
    float yacc[ROWS][16] __attribute__((aligned(32))) = {{0}};
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(32), *pk = head + GROUP_HEAD + hb * 16;
        if (prefetch) ahead(head, group_bytes(32));
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
        const int8_t *x0 = xq + g * 32;
        for (int64_t c = 0; c < 8; c++) { /* inputs 4c .. 4c + 3 */
            const __m128i p0 = _mm_loadu_si128((const __m128i *)(pk + 2 * c * 32));
            const __m128i p1 = _mm_loadu_si128((const __m128i *)(pk + (2 * c + 1) * 32));
            const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi16(p0, p1),
                                               _mm_unpacklo_epi16(p0, p1));
            const __m256i w0 = _mm256_and_si256(v, low);
            const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#define ROW8(i)                                                           \
            if (r > i) {                                                  \
                int32_t four;                                             \
                memcpy(&four, x0 + i * k + 4 * c, sizeof four);           \
                const __m256i xb = _mm256_set1_epi32(four);               \
                a##i = maddubs_acc(a##i, w0, xb);                         \
                b##i = maddubs_acc(b##i, w1, xb);                         \
            }
            ROW8(0) ROW8(1) ROW8(2) ROW8(3) ROW8(4) ROW8(5)
#undef ROW8
        }
        const __m256i as[ROWS] = {a0, a1, a2, a3, a4, a5}, bs[ROWS] = {b0, b1, b2, b3, b4, b5};
        __m256 sa, sb, za, zb;
        half_scales(head, hb, &sa, &sb, &za, &zb);
        for (int i = 0; i < r; i++) {
            const __m256 xs = _mm256_set1_ps(xsum[i * groups + g]);
            const __m256 a = _mm256_set1_ps(xa[i * groups + g]);
            _mm256_store_ps(yacc[i], GROUP_STEP(_mm256, _mm256_load_ps(yacc[i]),
                                                _mm256_madd_epi16(as[i], ones), a, sa, xs, za));
            _mm256_store_ps(yacc[i] + 8, GROUP_STEP(_mm256, _mm256_load_ps(yacc[i] + 8),
                                                    _mm256_madd_epi16(bs[i], ones), a, sb, xs,
                                                    zb));
        }
    }
    store_half(yacc, y, n, r, hb, out_fp32);
}

/* gemm4 with int8 inputs (groups of 32) for the blocks of 32 outputs from `first` on. */
static int gemm4_a8(const float *xf, const uint8_t *packed, void *y, int64_t m, int64_t n,
                    int64_t k, int out_fp32, int64_t first) {
    const int64_t groups = k / 32, blocks = n / 32, cells = m * groups;
    char *mem = malloc((size_t)(2 * cells) * sizeof(float) + (size_t)(m * k));
    if (!mem) return 1;
    float *xa = (float *)mem, *xsum = xa + cells;
    int8_t *xq = (int8_t *)(xsum + cells);
    quantize8(xf, m, k, xq, xa, xsum);
    #pragma omp parallel for schedule(static) if (blocks - first >= 4)
    for (int64_t b = first; b < blocks; b++) {
        const uint8_t *blk = packed + b * groups * group_bytes(32);
        for (int64_t i = 0; i < m; i += ROWS) {
            int r = m - i < ROWS ? (int)(m - i) : ROWS;
            char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
            for (int hb = 0; hb < 2; hb++) {
#define A8(R) half_block_a8(xq + i * k, k, xa + i * groups, xsum + i * groups, groups, blk, yi, \
                            n, R, hb, out_fp32, i == 0 && !hb)
                ROWS_CASES(A8)
#undef A8
            }
        }
    }
    free(mem);
    return 0;
}
#endif

/* xf: fp32 [m, k]; y: [m, n], bf16 or (out_fp32) fp32; outputs int8_from.. (a multiple of 32)
 * take int8 inputs where this build has the path and groups are 32, the rest int16. Returns
 * nonzero if out of memory. */
static int gemm4(const float *xf, const uint8_t *packed, void *y, int64_t m, int64_t n,
                 int64_t k, int64_t group, int out_fp32, int64_t int8_from) {
    int64_t groups = k / group, blocks = n / 32;
#ifdef A8_PATH
    if (group == 32 && int8_from < n) {
        if (gemm4_a8(xf, packed, y, m, n, k, out_fp32, int8_from / 32)) return 1;
        blocks = int8_from / 32;
        if (!blocks) return 0;
    }
#else
    (void)int8_from;
#endif
    rows16 x16;
    void *mem = quantize_rows(xf, m, k, group, &x16);
    if (!mem) return 1;
    const int16_t *xq = x16.q;
    const float *xa = x16.a, *xsum = x16.sum;
    #pragma omp parallel for schedule(static) if (blocks >= 4)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = packed + b * groups * group_bytes(group);
        for (int64_t i = 0; i < m; i += PASS_ROWS) {
            int r = m - i < PASS_ROWS ? (int)(m - i) : PASS_ROWS;
            const int16_t *xi = xq + i * k;
            const float *xs = xsum + i * groups, *as = xa + i * groups;
            char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
            /* constant output types too */
#define FP32(R) pass4(xi, k, as, xs, groups, group, blk, yi, n, R, 1, i == 0)
#define BF16(R) pass4(xi, k, as, xs, groups, group, blk, yi, n, R, 0, i == 0)
            if (out_fp32) PASS_CASES(FP32) else PASS_CASES(BF16)
#undef FP32
#undef BF16
        }
    }
    free(mem);
    return 0;
}

/* The shapes and int8_from (0..n, a multiple of 32) int4_gemm and int4_gemm_f32 do not take. */
static int declined(int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    return n % 32 || k % group || group % 2 || int8_from < 0 || int8_from > n || int8_from % 32;
}

/* x: bf16 [m, k]; y: bf16 [m, n]; xsum: avx512_gemm.c's scratch, unused here; int8_from as
 * int4_gemm_f32's. */
int avx2_int4_gemm(const uint16_t *x, const uint8_t *packed, uint16_t *y, float *xsum, int64_t m,
                   int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    if (declined(n, k, group, int8_from)) return 1;
    float *xf = to_fp32(x, m, k);
    if (!xf) return 1;
    int failed = gemm4(xf, packed, y, m, n, k, group, 0, int8_from);
    free(xf);
    return failed;
}

/* fp32 in and out (the compute dtype of CPUs without fast bf16): x and y are never rounded.
 * Outputs int8_from.. (0..n, a multiple of 32; n: none) take the inputs as int8 where this
 * build has that path (avx2_gemm_a8) and groups are 32; elsewhere it changes nothing. */
int avx2_int4_gemm_f32(const float *x, const uint8_t *packed, float *y, float *xsum, int64_t m,
                       int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    if (declined(n, k, group, int8_from)) return 1;
    return gemm4(x, packed, y, m, n, k, group, 1, int8_from);
}

/* The weight as bf16 [k][n] (transposed), rows [k0, k1): w = (q - 8) * scale + zero in fp32,
 * rounded to nearest even (avx512_gemm.c's, scalar). */
int avx2_int4_unpack_q4x32(const uint8_t *packed, uint16_t *out, int64_t n, int64_t k,
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
 * quarter (16 bytes) holds 8 outputs' pairs: sign-extended to 16 int16 lanes, 32-bit lane i is
 * output o's pair, which vpmaddwd multiplies by (X[2p], X[2p + 1]), x as int16 per group of
 * `xg` inputs (quantize16). The block goes in halves of 16 outputs (32 bytes of each pair). */
static inline void half_block8(const int16_t *xq, int64_t k, const float *xa, int64_t xg,
                               const int8_t *blk, const float *scale, void *y, int64_t n,
                               const int r, const int hb, int out_fp32, int prefetch) {
    float yacc[ROWS][16] __attribute__((aligned(32))) = {{0}};
    int64_t groups = k / xg;
    for (int64_t g = 0; g < groups; g++) {
        __m256i a0[ROWS], a1[ROWS];
        if (prefetch) ahead(blk + g * xg * 32, xg * 32);
        pair_sums(xq + g * xg, k, xg / 2, (const uint8_t *)blk + g * xg * 32 + hb * 32, 1, r, a0,
                  a1);
        for (int i = 0; i < r; i++) {
            __m256 a = _mm256_set1_ps(xa[i * groups + g]);
            _mm256_store_ps(yacc[i], INT8_STEP(_mm256, _mm256_load_ps(yacc[i]), a0[i], a));
            _mm256_store_ps(yacc[i] + 8, INT8_STEP(_mm256, _mm256_load_ps(yacc[i] + 8), a1[i], a));
        }
    }
    const __m256 s0 = _mm256_loadu_ps(scale + 16 * hb), s1 = _mm256_loadu_ps(scale + 16 * hb + 8);
    for (int i = 0; i < r; i++) {
        __m256 v0 = _mm256_mul_ps(_mm256_load_ps(yacc[i]), s0);
        __m256 v1 = _mm256_mul_ps(_mm256_load_ps(yacc[i] + 8), s1);
        if (out_fp32) {
            _mm256_storeu_ps((float *)y + i * n + 16 * hb, v0);
            _mm256_storeu_ps((float *)y + i * n + 16 * hb + 8, v1);
        } else {
            store_bf16((uint16_t *)y + i * n + 16 * hb, v0);
            store_bf16((uint16_t *)y + i * n + 16 * hb + 8, v1);
        }
    }
}

#ifndef WIDE_ROWS
static inline __attribute__((always_inline)) void pass8(
        const int16_t *xq, int64_t k, const float *xa, int64_t xg, const int8_t *blk,
        const float *scale, void *y, int64_t n, const int r, int out_fp32, int prefetch) {
    for (int hb = 0; hb < 2; hb++)
        half_block8(xq, k, xa, xg, blk, scale, y, n, r, hb, out_fp32, prefetch && !hb);
}
#endif

/* Returns nonzero if out of memory. */
static int gemm8(const float *xf, const int8_t *packed, const float *scale, void *y,
                 int64_t m, int64_t n, int64_t k, int out_fp32) {
    int64_t blocks = n / 32, xg = 2;  /* x's groups: 32 inputs, or the most that divide k */
    for (int64_t c = 32; c > 2; c /= 2)
        if (k % c == 0) {
            xg = c;
            break;
        }
    rows16 x16;
    void *mem = quantize_rows(xf, m, k, xg, &x16);
    if (!mem) return 1;
    const int16_t *xq = x16.q;
    const float *xa = x16.a;
    #pragma omp parallel for schedule(static) if (blocks >= 4)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *blk = packed + b * k * 32;
        for (int64_t i = 0; i < m; i += PASS_ROWS) {
            int r = m - i < PASS_ROWS ? (int)(m - i) : PASS_ROWS;
            const int16_t *xi = xq + i * k;
            const float *ai = xa + i * (k / xg), *sc = scale + b * 32;
            char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
#define BLOCK8(R) pass8(xi, k, ai, xg, blk, sc, yi, n, R, out_fp32, i == 0)
            PASS_CASES(BLOCK8);
#undef BLOCK8
        }
    }
    free(mem);
    return 0;
}

/* x: bf16 [m, k]; scale: fp32 [n]; y: [m, n], bf16 or (out_fp32: logits) fp32. */
int avx2_int8_gemm(const uint16_t *x, const int8_t *packed, const float *scale, void *y, int64_t m,
                   int64_t n, int64_t k, int out_fp32) {
    if (n % 32 || k % 2) return 1;
    float *xf = to_fp32(x, m, k);
    if (!xf) return 1;
    int failed = gemm8(xf, packed, scale, y, m, n, k, out_fp32);
    free(xf);
    return failed;
}

/* fp32 in and out. */
int avx2_int8_gemm_f32(const float *x, const int8_t *packed, const float *scale, float *y,
                       int64_t m, int64_t n, int64_t k) {
    if (n % 32 || k % 2) return 1;
    return gemm8(x, packed, scale, y, m, n, k, 1);
}

int avx2_gemm_available(void) { return 1; }

#else

int avx2_int4_gemm(const void *x, const void *packed, void *y, void *xsum, int64_t m, int64_t n,
                   int64_t k, int64_t group, int64_t int8_from) {
    return 1;
}

int avx2_int4_unpack_q4x32(const void *packed, void *out, int64_t n, int64_t k, int64_t group,
                           int64_t k0, int64_t k1) {
    return 1;
}

int avx2_int8_gemm(const void *x, const void *packed, const void *scale, void *y, int64_t m,
                   int64_t n, int64_t k, int out_fp32) {
    return 1;
}

int avx2_int4_gemm_f32(const void *x, const void *packed, void *y, void *xsum, int64_t m,
                       int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    return 1;
}

int avx2_int8_gemm_f32(const void *x, const void *packed, const void *scale, void *y, int64_t m,
                       int64_t n, int64_t k) {
    return 1;
}

int avx2_gemm_available(void) { return 0; }

#endif

/* 1 where this build has the int8-activation path int4_gemm_f32's int8_from asks for (plain
      * AVX2), else 0. */
#ifdef A8_PATH
int avx2_gemm_a8(void) { return 1; }
#else
int avx2_gemm_a8(void) { return 0; }
#endif

/* 1 where the AVX-512 VNNI path is compiled in (said at load), else 0. */
#ifdef WIDE_ROWS
int avx2_gemm_wide(void) { return 1; }
#else
int avx2_gemm_wide(void) { return 0; }
#endif

/* 1 where the AVX2 path's sums come from AVX-VNNI's vpdpwssd (said at load), else 0. */
#ifdef VEX_VNNI
int avx2_gemm_vex_vnni(void) { return 1; }
#else
int avx2_gemm_vex_vnni(void) { return 0; }
#endif
