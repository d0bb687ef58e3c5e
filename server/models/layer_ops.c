/* The small per-layer operations of a decoder step, each in one pass (layer_ops.py calls them).
 *
 * In PyTorch each of these is 6-25 operator calls of a few microseconds each at decode sizes:
 * at one sequence they were most of a 135M model's step. Every function computes a row (a
 * token, or a query head) with a fixed sequence of instructions that depends on that row's own
 * sizes only, never on how many rows share the call, so results are batch invariant.
 *
 * Values are fp32 or bf16 (flag `*_bf16`); arithmetic is fp32, bf16 results are rounded to
 * nearest even. Built with -ffp-contract=off: no fused multiply-adds, the same results wherever
 * the compiler vectorizes. Sums over a vector run in 16 interleaved lanes added pairwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
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

static inline void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

#define LANES 16

static inline float lane_sum(float acc[LANES]) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

/* sum a[i] * b[i], in LANES lanes then pairwise; the tail (n % LANES) added last in order. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    float s = lane_sum(acc);
    for (; i < n; i++) s = s + a[i] * b[i];
    return s;
}

#define MAX_DIM 1024  /* the widest head these take */
#define MAX_HIDDEN 16384  /* the widest row rms_norm takes */

/* e^x for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n by its exponent
 * bits; within 2 ulp), pure arithmetic so that loops over it vectorize. n = round(x / ln2) by
 * adding and subtracting 1.5 * 2^23 (exact for |x / ln2| < 2^22). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* RMSNorm of t rows of h values: y = weight * round(x / rms(x)) as the reference implementation
 * computes it (normalize in fp32, round to the input dtype, scale in the input dtype). */
int rms_norm(const void *x, const void *weight, void *out, int64_t t, int64_t h, double eps,
             int bf16) {
    if (h > MAX_HIDDEN) return 1;
    #pragma omp parallel for schedule(static) if (t >= 8)
    for (int64_t r = 0; r < t; r++) {
        float row[MAX_HIDDEN], w[MAX_HIDDEN];
        size_t es = bf16 ? 2 : 4;
        load_row(row, (const char *)x + r * h * es, h, bf16);
        load_row(w, weight, h, bf16);
        float ss = dot(row, row, h);
        float inv = 1.0f / sqrtf(ss / (float)h + (float)eps);
        for (int64_t i = 0; i < h; i++) {
            float v = row[i] * inv;
            if (bf16) v = bf16_to_float(float_to_bf16(v));
            row[i] = w[i] * v;
        }
        store_row((char *)out + r * h * es, row, h, bf16);
    }
    return 0;
}

/* Rotary embedding and cache write for t tokens of a fused q|k|v projection.
 * qkv: [t, row_stride] (q heads first, then k, then v, each head d wide), dtype `bf16`;
 * cos/sin: fp32 [max_pos, d] tables; q_out: [t, hq, d] roped queries, dtype `bf16`;
 * k_cache/v_cache: [hkv, num_slots, d], dtype `cache_bf16`; token i's k (roped) and v go to
 * slot slots[i]. Rotation as rotate_half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
int rope_store(const void *qkv, int64_t t, int64_t row_stride, int64_t hq, int64_t hkv,
               int64_t d, const float *cos_t, const float *sin_t, const int64_t *positions,
               const int64_t *slots, void *q_out, void *k_cache, void *v_cache,
               int64_t num_slots, int bf16, int cache_bf16) {
    if (d % 2 || d > MAX_DIM) return 1;
    size_t es = bf16 ? 2 : 4, ces = cache_bf16 ? 2 : 4;
    int64_t half = d / 2, heads = hq + 2 * hkv;
    #pragma omp parallel for schedule(static) if (t * heads >= 256)
    for (int64_t job = 0; job < t * heads; job++) {
        int64_t i = job / heads, h = job % heads;
        float x[MAX_DIM], y[MAX_DIM];
        const float *c = cos_t + positions[i] * d, *s = sin_t + positions[i] * d;
        load_row(x, (const char *)qkv + (i * row_stride + h * d) * es, d, bf16);
        if (h < hq + hkv) {
            for (int64_t j = 0; j < half; j++) {
                y[j] = x[j] * c[j] - x[j + half] * s[j];
                y[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
            }
        } else {
            memcpy(y, x, (size_t)d * sizeof(float));
        }
        if (h < hq) {
            store_row((char *)q_out + (i * hq + h) * d * es, y, d, bf16);
        } else {
            int64_t kh = h < hq + hkv ? h - hq : h - hq - hkv;
            char *cache = (char *)(h < hq + hkv ? k_cache : v_cache);
            store_row(cache + (kh * num_slots + slots[i]) * d * ces, y, d, cache_bf16);
        }
    }
    return 0;
}

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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef float vf __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) {
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
#define VL 8
typedef float vf __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
#endif
typedef uint16_t u16v __attribute__((vector_size(2 * VL)));
typedef uint32_t u32v __attribute__((vector_size(4 * VL)));

typedef int32_t i32v __attribute__((vector_size(4 * VL)));

static inline vf vmax(vf a, vf b) {
    i32v take = a > b;
    return (vf)((take & (i32v)a) | (~take & (i32v)b));
}

static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

static inline vf loadv(const char *p, int bf16) {
    vf f;
    if (bf16) {
        u16v h;
        memcpy(&h, p, sizeof h);
        u32v w = __builtin_convertvector(h, u32v) << 16;
        memcpy(&f, &w, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
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

/* One sequence's kv head: `group` of its query heads over n context positions. Inlined with a
 * literal group and cache dtype (the hot loops'), so that each case keeps its accumulators in
 * registers; the queries' dtype is read once and written once. */
static inline __attribute__((always_inline)) void decode_head(
        const char *q, const int64_t group, const char *kbase, const char *vbase,
        const int64_t *sl, int64_t n, int64_t d, float scale, float *score, int64_t max_ctx,
        char *out, int bf16, const int cache_bf16) {
    size_t es = bf16 ? 2 : 4, ces = cache_bf16 ? 2 : 4;
    int64_t chunks = d / VL;
    vf qv[4][MAX_DIM / VL];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            qv[g][c] = loadv(q + (g * d + c * VL) * es, bf16) * scale;
    /* Scores VL positions at a time: each position's key is loaded once for every query head,
     * and each (head, position)'s products are summed across lanes by one tree (positions past
     * n in the last block are zeros, never stored). */
    for (int64_t p0 = 0; p0 < n; p0 += VL) {
        int64_t count = n - p0 < VL ? n - p0 : VL;
        vf part[4][VL];
        for (int64_t j = 0; j < VL; j++) {
            if (j >= count) {
                for (int64_t g = 0; g < group; g++) part[g][j] = (vf){0};
                continue;
            }
            const char *k = kbase + sl[p0 + j] * d * ces;
            /* The next block's keys and this position's values, from memory while this block
             * computes (a block of the pool is a few cache lines; blocks lie anywhere). */
            if (p0 + VL + j < n) prefetch_row(kbase + sl[p0 + VL + j] * d * ces, d * ces);
            prefetch_row(vbase + sl[p0 + j] * d * ces, d * ces);
            vf acc[4], kc = loadv(k, cache_bf16);
            for (int64_t g = 0; g < group; g++) acc[g] = qv[g][0] * kc;
            for (int64_t c = 1; c < chunks; c++) {
                kc = loadv(k + c * VL * ces, cache_bf16);
                for (int64_t g = 0; g < group; g++) acc[g] = vfma(qv[g][c], kc, acc[g]);
            }
            for (int64_t g = 0; g < group; g++) part[g][j] = acc[g];
        }
        for (int64_t g = 0; g < group; g++) {
            float sv[VL];
            vf s = sum_lanes(part[g]);
            memcpy(sv, &s, sizeof sv);
            memcpy(score + g * max_ctx + p0, sv, (size_t)count * sizeof(float));
        }
    }
    float denom[4];
    for (int64_t g = 0; g < group; g++) {
        float *sc = score + g * max_ctx, peak = -INFINITY;
        int64_t p = 0;
        if (n >= VL) {  /* the maximum in lanes, then across them (exact in any order) */
            vf m;
            memcpy(&m, sc, sizeof m);
            for (p = VL; p + VL <= n; p += VL) {
                vf x;
                memcpy(&x, sc + p, sizeof x);
                m = vmax(m, x);
            }
            float lane[VL];
            memcpy(lane, &m, sizeof lane);
            for (int l = 0; l < VL; l++) peak = lane[l] > peak ? lane[l] : peak;
        }
        for (; p < n; p++) peak = sc[p] > peak ? sc[p] : peak;
        for (int64_t p = 0; p < n; p++) sc[p] = exp_neg(sc[p] - peak);
        float lanes[LANES] = {0};
        for (p = 0; p + LANES <= n; p += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] = lanes[l] + sc[p + l];
        denom[g] = lane_sum(lanes);
        for (; p < n; p++) denom[g] = denom[g] + sc[p];
    }
    /* The weighted sum of values, one vector of every head's output at a time. */
    for (int64_t c = 0; c < chunks; c++) {
        vf acc[4];
        for (int64_t g = 0; g < group; g++) acc[g] = (vf){0};
        for (int64_t p = 0; p < n; p++) {
            vf vv = loadv(vbase + (sl[p] * d + c * VL) * ces, cache_bf16);
            for (int64_t g = 0; g < group; g++)
                acc[g] = vfma((vf){0} + score[g * max_ctx + p], vv, acc[g]);
        }
        for (int64_t g = 0; g < group; g++) {
            float row[VL];
            vf o = acc[g] / denom[g];
            memcpy(row, &o, sizeof o);
            store_row(out + (g * d + c * VL) * es, row, VL, bf16);
        }
    }
}

/* decode_head on query heads in blocks of at most 4 (each block reads the keys and values
 * again), inlined with a literal block size and cache dtype: 8 instantiations, each keeping its
 * accumulators in registers (compiled in about a second). */
static void decode_job(const char *q, int64_t group, const char *kbase, const char *vbase,
                       const int64_t *sl, int64_t n, int64_t d, float scale, float *score,
                       int64_t max_ctx, char *out, int bf16, int cache_bf16) {
    size_t es = bf16 ? 2 : 4;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        int64_t heads = group - g0 < 4 ? group - g0 : 4;
        const char *qb = q + g0 * d * es;
        char *ob = out + g0 * d * es;
#define DECODE_HEADS(G)                                                                       \
    do {                                                                                      \
        if (cache_bf16)                                                                       \
            decode_head(qb, G, kbase, vbase, sl, n, d, scale, score, max_ctx, ob, bf16, 1);   \
        else                                                                                  \
            decode_head(qb, G, kbase, vbase, sl, n, d, scale, score, max_ctx, ob, bf16, 0);   \
    } while (0)
        switch (heads) {
            case 1: DECODE_HEADS(1); break;
            case 2: DECODE_HEADS(2); break;
            case 3: DECODE_HEADS(3); break;
            default: DECODE_HEADS(4); break;
        }
#undef DECODE_HEADS
    }
}

/* One generated token per entry b, attending over its own context in the paged cache.
 * q: [b, hq, d] (dtype `bf16`), scaled by `scale` here; caches [hkv, num_slots, d]
 * (`cache_bf16`); ctx_slots: [b, max_ctx] cache slot of each context position, lens[b]
 * positions real; out: [b, hq * d] (`bf16`). Scores, softmax and the weighted sum are fp32,
 * each query head over its own positions in order. Returns 2 if out of memory. */
int paged_decode(const void *q, const void *k_cache, const void *v_cache,
                 const int64_t *ctx_slots, const int64_t *lens, void *out, int64_t b,
                 int64_t hq, int64_t hkv, int64_t d, int64_t max_ctx, int64_t num_slots,
                 double scale, int bf16, int cache_bf16) {
    if (d > MAX_DIM || d % VL || hq % hkv) return 1;
    for (int64_t e = 0; e < b; e++)
        if (lens[e] < 1 || lens[e] > max_ctx) return 1;
    size_t es = bf16 ? 2 : 4, ces = cache_bf16 ? 2 : 4;
    int64_t group = hq / hkv, work = 0, longest = 0;
    for (int64_t e = 0; e < b; e++) {
        work += lens[e];
        longest = lens[e] > longest ? lens[e] : longest;
    }
    int failed = 0;
    /* A job is one kv head of one entry with its `group` query heads (they share the keys and
     * values; one query head a job was slower even at one entry). Each thread keeps its jobs'
     * scores in one buffer of its own. */
    #pragma omp parallel if (work * hq * d >= (1 << 15))
    {
        float *sc = malloc((size_t)(group * longest) * sizeof(float));
        if (sc == NULL) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < b * hkv; job++) {
            if (sc == NULL) continue;
            int64_t e = job / hkv, h = job % hkv * group, kh = job % hkv;
            const char *qe = (const char *)q + (e * hq + h) * d * es;
            const char *kbase = (const char *)k_cache + kh * num_slots * d * ces;
            const char *vbase = (const char *)v_cache + kh * num_slots * d * ces;
            char *oe = (char *)out + (e * hq + h) * d * es;
            const int64_t *sl = ctx_slots + e * max_ctx;
            int64_t n = lens[e];
            float sf = (float)scale;
            decode_job(qe, group, kbase, vbase, sl, n, d, sf, sc, longest, oe, bf16, cache_bf16);
        }
        free(sc);
    }
    return failed;
}
