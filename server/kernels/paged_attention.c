/* Paged attention over the KV cache pool: decode queries (paged_decode) and prompt chunks
 * (paged_prompt), built into one library with layer_ops.c and dense_gemm.c (layer_ops.py).
 * Scores, softmax and weighted sums are fp32; every query row's numbers depend on its own query
 * and context only. */
#define _GNU_SOURCE /* syscall() in unistd.h under -std=c11 (amx_tiles.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "common.h"
#include "layer_ops.h"
#include "vectors.h"

/* Each row r's scores (score + r * stride) over its own n[r] positions become e^(s - max), their
 * sum in denom[r]; positions [n[r], nmax) become zeros. */
static inline void softmax_rows(float *score, const int R, const int64_t *n, int64_t nmax,
                                int64_t stride, float *denom) {
    for (int r = 0; r < R; r++) {
        float *sc = score + r * stride, peak = -INFINITY;
        int64_t p = 0, len = n[r];
        if (len >= VL) {  /* the maximum in lanes, then across them (exact in any order) */
            vf m;
            memcpy(&m, sc, sizeof m);
            for (p = VL; p + VL <= len; p += VL) {
                vf x;
                memcpy(&x, sc + p, sizeof x);
                m = vmax(m, x);
            }
            float lane[VL];
            memcpy(lane, &m, sizeof lane);
            for (int l = 0; l < VL; l++) peak = lane[l] > peak ? lane[l] : peak;
        }
        for (; p < len; p++) peak = sc[p] > peak ? sc[p] : peak;
        for (p = 0; p < len; p += VL) {  /* the last vector part padding, not stored */
            int64_t count = len - p < VL ? len - p : VL;
            store_lanes(sc + p, exp_negv(load_lanes(sc + p, count) - peak), count);
        }
        for (p = len; p < nmax; p++) sc[p] = 0.0f;
        /* LANES interleaved sums, VL lanes a vector */
        vf lv[LANES / VL] = {{0}};
        for (p = 0; p + LANES <= len; p += LANES)
            for (int l = 0; l < LANES / VL; l++) {
                vf x;
                memcpy(&x, sc + p + l * VL, sizeof x);
                lv[l] = lv[l] + x;
            }
        float lanes[LANES];
        memcpy(lanes, lv, sizeof lanes);
        denom[r] = lane_sum(lanes);
        for (; p < len; p++) denom[r] = denom[r] + sc[p];
    }
}

/* Rows [0, R) of the weighted sums of values over positions [0, nmax) in order (weights wt
 * position-major), output vectors [c, c + CB) of each row, divided by the row's denominator:
 * R x CB independent sums, so that the FMAs' latency overlaps. */
static inline __attribute__((always_inline)) void weighted_sums(
        const float *wt, const int R, const int CB, int64_t nmax, const char *vbase,
        const int64_t *sl, int64_t d, int64_t c, const float *denom, float *o,
        const int cache_bf16) {
    size_t ces = cache_bf16 ? 2 : 4;
    vf acc[R][CB];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < CB; i++) acc[r][i] = (vf){0};
    for (int64_t p = 0; p < nmax; p++) {
        const char *v = vbase + (sl[p] * d + c * VL) * ces;
        for (int i = 0; i < CB; i++) {
            vf vv = loadv(v + i * VL * ces, cache_bf16);
            for (int r = 0; r < R; r++) acc[r][i] = vfma(splat(wt[p * R + r]), vv, acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < CB; i++) {
            vf v = acc[r][i] / denom[r];
            memcpy(o + r * d + (c + i) * VL, &v, sizeof v);
        }
}

/* R query heads of one decode query (qs: fp32 [R][d], already scaled), sharing one kv head, over
 * its n context positions: o fp32 [R][d]. Inlined with a literal R and cache dtype (the hot
 * loops'), so that each case keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void decode_heads(
        const float *qs, const int R, int64_t nmax, const char *kbase,
        const char *vbase, const int64_t *sl, int64_t d, float *score, int64_t max_ctx,
        float *o, const int cache_bf16) {
    size_t ces = cache_bf16 ? 2 : 4;
    int64_t chunks = d / VL;
    /* Scores VL positions at a time: each position's key is loaded once for every row, and
     * each (row, position)'s products are summed across lanes by one tree (positions past
     * nmax in the last block are zeros, never stored). */
    for (int64_t p0 = 0; p0 < nmax; p0 += VL) {
        int64_t count = nmax - p0 < VL ? nmax - p0 : VL;
        vf part[R][VL];
        for (int64_t j = 0; j < VL; j++) {
            if (j >= count) {
                for (int r = 0; r < R; r++) part[r][j] = (vf){0};
                continue;
            }
            const char *k = kbase + sl[p0 + j] * d * ces;
            /* The next block's keys and this position's values, from memory while this block
             * computes (a block of the pool is a few cache lines; blocks lie anywhere). */
            if (p0 + VL + j < nmax) prefetch_row(kbase + sl[p0 + VL + j] * d * ces, d * ces);
            prefetch_row(vbase + sl[p0 + j] * d * ces, d * ces);
            vf acc[R], kc = loadv(k, cache_bf16), qc;
            for (int r = 0; r < R; r++) {
                memcpy(&qc, qs + r * d, sizeof qc);
                acc[r] = qc * kc;
            }
            for (int64_t c = 1; c < chunks; c++) {
                kc = loadv(k + c * VL * ces, cache_bf16);
                for (int r = 0; r < R; r++) {
                    memcpy(&qc, qs + r * d + c * VL, sizeof qc);
                    acc[r] = vfma(qc, kc, acc[r]);
                }
            }
            for (int r = 0; r < R; r++) part[r][j] = acc[r];
        }
        for (int r = 0; r < R; r++) store_lanes(score + r * max_ctx + p0, sum_lanes(part[r]), count);
    }
    float denom[R];
    int64_t n[R];
    for (int r = 0; r < R; r++) n[r] = nmax;
    softmax_rows(score, R, n, nmax, max_ctx, denom);
    /* The weighted sums of values, CB vectors of every row's output at a time, the weights
     * position-major (after the scores, in the same buffer) so that one pointer reads them. */
    float *wt = score + R * max_ctx;
    for (int64_t p = 0; p < nmax; p++)
        for (int r = 0; r < R; r++) wt[p * R + r] = score[r * max_ctx + p];
    const int CB = R <= 3 ? 4 : 2;  /* at most 12 sums in registers (AVX2 has 16) */
    int64_t c = 0;
    for (; c + CB <= chunks; c += CB)
        weighted_sums(wt, R, CB, nmax, vbase, sl, d, c, denom, o, cache_bf16);
    for (; c < chunks; c++) weighted_sums(wt, R, 1, nmax, vbase, sl, d, c, denom, o, cache_bf16);
}

/* One query row (d values, `bf16`) into fp32, scaled. */
static inline void load_scaled(float *dst, const char *src, int64_t d, float scale, int bf16) {
    size_t es = bf16 ? 2 : 4;
    for (int64_t c = 0; c < d / VL; c++) {
        vf v = loadv(src + c * VL * es, bf16) * scale;
        memcpy(dst + c * VL, &v, sizeof v);
    }
}

/* One sequence's kv head: `group` of its query heads over n context positions, in blocks of
 * at most 4 heads (each block reads the keys and values again), inlined with a literal block
 * size and cache dtype: 8 instantiations. */
static void decode_job(const char *q, int64_t group, const char *kbase, const char *vbase,
                       const int64_t *sl, int64_t n, int64_t d, float scale, float *score,
                       int64_t max_ctx, char *out, int bf16, int cache_bf16) {
    size_t es = bf16 ? 2 : 4;
    float qs[4 * MAX_DIM], os[4 * MAX_DIM];
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        int64_t heads = group - g0 < 4 ? group - g0 : 4;
        for (int64_t r = 0; r < heads; r++)
            load_scaled(qs + r * d, q + (g0 + r) * d * es, d, scale, bf16);
#define DECODE_HEADS(G)                                                                       \
    do {                                                                                      \
        if (cache_bf16)                                                                       \
            decode_heads(qs, G, n, kbase, vbase, sl, d, score, max_ctx, os, 1);               \
        else                                                                                  \
            decode_heads(qs, G, n, kbase, vbase, sl, d, score, max_ctx, os, 0);               \
    } while (0)
        switch (heads) {
            case 1: DECODE_HEADS(1); break;
            case 2: DECODE_HEADS(2); break;
            case 3: DECODE_HEADS(3); break;
            default: DECODE_HEADS(4); break;
        }
#undef DECODE_HEADS
        for (int64_t r = 0; r < heads; r++)
            store_row(out + (g0 + r) * d * es, os + r * d, d, bf16);
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
        float *sc = malloc((size_t)(2 * 4 * longest) * sizeof(float));  /* decode_heads' two */
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

#define PROMPT_ROWS 12 /* rows a prompt job attends at once: its queries times their heads */
#define SCORE_ROWS 6 /* rows of a block of scores: 6 x 2 vectors of sums (12 AVX2 registers) */
#define SUM_ROWS 4 /* rows of a block of weighted sums: 4 x 2 vectors */
/* Prompt positions below this attend here, the rest in attention.py's tiles of batched matmuls,
 * which catch up past it (per layer at 512 positions here 2.8-4.9 ms against 2.8-4.7, at 2,048
 * 44-68 against 46-62: Zen 4 with AVX-512, and held to AVX2) */
#define PROMPT_POSITIONS 512

int64_t prompt_positions(void) { return PROMPT_POSITIONS; }

/* A prompt job's PROMPT_ROWS rows (qs, scaled) against one kv head's keys transposed (kt [d]
 * [ctxp], zeros past the context) and values (vg [ctx][d]), row r over positions [0, n[r]):
 * scores vectorized over positions, each (row, position)'s products summed over d in order,
 * then softmax_rows, then the weighted sums over positions in order (weights past a row's own
 * positions are exact zeros added to sums that start at +0). o: fp32 [PROMPT_ROWS][d]. */
static void prompt_rows(const float *qs, const int64_t *n, int64_t nmax, const float *kt,
                        int64_t ctxp, const float *vg, int64_t d, float *score, float *o) {
    const int R = PROMPT_ROWS;
    for (int64_t p0 = 0; p0 < nmax; p0 += 2 * VL)
        for (int r0 = 0; r0 < R; r0 += SCORE_ROWS) {
            vf a[SCORE_ROWS][2];
            for (int i = 0; i < SCORE_ROWS; i++) a[i][0] = a[i][1] = (vf){0};
            for (int64_t c = 0; c < d; c++) {
                vf k0, k1;
                memcpy(&k0, kt + c * ctxp + p0, sizeof k0);
                memcpy(&k1, kt + c * ctxp + p0 + VL, sizeof k1);
                for (int i = 0; i < SCORE_ROWS; i++) {
                    vf qv = splat(qs[(r0 + i) * d + c]);
                    a[i][0] = vfma(qv, k0, a[i][0]);
                    a[i][1] = vfma(qv, k1, a[i][1]);
                }
            }
            for (int i = 0; i < SCORE_ROWS; i++)
                memcpy(score + (r0 + i) * ctxp + p0, a[i], sizeof a[i]);
        }
    float denom[PROMPT_ROWS], *wt = score + R * ctxp;
    softmax_rows(score, R, n, nmax, ctxp, denom);
    for (int64_t p = 0; p < nmax; p++)
        for (int r = 0; r < R; r++) wt[p * R + r] = score[r * ctxp + p];
    for (int64_t c0 = 0; c0 < d; c0 += 2 * VL)
        for (int r0 = 0; r0 < R; r0 += SUM_ROWS) {
            vf a[SUM_ROWS][2];
            for (int i = 0; i < SUM_ROWS; i++) a[i][0] = a[i][1] = (vf){0};
            for (int64_t p = 0; p < nmax; p++) {
                vf v0, v1;
                memcpy(&v0, vg + p * d + c0, sizeof v0);
                memcpy(&v1, vg + p * d + c0 + VL, sizeof v1);
                for (int i = 0; i < SUM_ROWS; i++) {
                    vf w = splat(wt[p * R + r0 + i]);
                    a[i][0] = vfma(w, v0, a[i][0]);
                    a[i][1] = vfma(w, v1, a[i][1]);
                }
            }
            for (int i = 0; i < SUM_ROWS; i++)
                for (int j = 0; j < 2; j++) {
                    vf v = a[i][j] / denom[r0 + i];
                    memcpy(o + (r0 + i) * d + c0 + j * VL, &v, sizeof v);
                }
        }
}

#if defined(AMX_TILES) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* bf16 prompt chunks on AMX tiles, where dense_gemm.c's tiles are on (packed_gemm_tiles): the
 * scores q.k and the weighted sums p.v are TDPBF16PS products summed in fp32, the softmax fp32
 * between them, its weights rounded to bf16 for the second product (as PyTorch's CPU flash
 * attention does for bf16) and the sums divided by the fp32 denominator. A job is 16 rows (a
 * query head of a query each) of one kv head. Context positions are aligned to the sequence's
 * start in blocks of 16 (scores) and 32 (sums), and a row's weights past its own positions are
 * exact zeros: a row's bits depend on its own query and context only, whole, in chunks or after
 * a prefix hit. Keys are laid out as B tiles [ctx / 16][d / 32][16 pairs of d][16 positions][2],
 * values as [ctx / 32][d / 16][16 pairs of positions][16 of d][2], one 1 KB tile each. */
#define PROMPT_TILES 1

/* 16 rows (qa [16][d] bf16; rows [real, 16) zeros) over positions [0, np) (a multiple of 32)
 * of one kv head's kb/vb; row r's own positions [0, len[r]). sc: fp32 [16][np], pw: bf16
 * [16][np], os: fp32 [16][d]; the sums of row r, divided, into os. */
static void prompt_tile_rows(const uint16_t *qa, int real, const int64_t *len, int64_t np,
                             int64_t d, const uint16_t *kb, const uint16_t *vb, float scale,
                             float *sc, uint16_t *pw, float *os) {
    const int64_t dc = d / 32, db = d / 16;
    for (int64_t p0 = 0; p0 < np; p0 += 64) {  /* scores, 4 (or 2) blocks of 16 positions */
        const int four = np - p0 >= 64;
        const uint16_t *k0 = kb + p0 / 16 * dc * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < dc; c++) {
            tile_load(4, qa + c * 32, d * 2);
            tile_load(5, k0 + c * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            tile_load(6, k0 + (dc + c) * 512, 64);
            _tile_dpbf16ps(1, 4, 6);
            if (four) {
                tile_load(7, k0 + (2 * dc + c) * 512, 64);
                _tile_dpbf16ps(2, 4, 7);
                tile_load(5, k0 + (3 * dc + c) * 512, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, sc + p0, np * 4);
        _tile_stored(1, sc + p0 + 16, np * 4);
        if (four) {
            _tile_stored(2, sc + p0 + 32, np * 4);
            _tile_stored(3, sc + p0 + 48, np * 4);
        }
    }
    float denom[16];
    for (int r = 0; r < real; r++)
        for (int64_t p = 0; p < len[r]; p += 16) {
            __m512 v = _mm512_loadu_ps(sc + r * np + p);
            _mm512_storeu_ps(sc + r * np + p, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
        }
    softmax_rows(sc, real, len, np, np, denom);
    for (int r = 0; r < 16; r++)
        for (int64_t p = 0; p < np; p += 16) {
            __m512 v = r < real ? _mm512_loadu_ps(sc + r * np + p) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(pw + r * np + p), (__m256i)_mm512_cvtneps_pbh(v));
        }
    for (int64_t b0 = 0; b0 < db; b0 += 4) {  /* weighted sums, 4 blocks of 16 of d a pass */
        const int nd = db - b0 < 4 ? (int)(db - b0) : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t q = 0; q < np / 32; q++) {
            const uint16_t *v0 = vb + (q * db + b0) * 512;
            tile_load(4, pw + q * 32, np * 2);
            tile_load(5, v0, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) {
                tile_load(6, v0 + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nd > 2) {
                tile_load(7, v0 + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (nd > 3) {
                tile_load(5, v0 + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, os + b0 * 16, d * 4);
        if (nd > 1) _tile_stored(1, os + (b0 + 1) * 16, d * 4);
        if (nd > 2) _tile_stored(2, os + (b0 + 2) * 16, d * 4);
        if (nd > 3) _tile_stored(3, os + (b0 + 3) * 16, d * 4);
    }
    for (int r = 0; r < real; r++)
        for (int64_t c = 0; c < d; c++) os[r * d + c] = os[r * d + c] / denom[r];
}

/* 16 positions' keys (rows[i]: position i's d values; NULL: zeros) as B tiles, kt [d / 32][16
 * pairs of d][16 positions] of bf16 pairs: a 16 x 16 transpose of 32-bit pairs a group. */
static void key_tiles(const uint16_t *const *rows, int64_t d, uint32_t *kt) {
    for (int64_t g = 0; g < d / 32; g++) {
        __m512i r[16], t[16];
        for (int i = 0; i < 16; i++)
            r[i] = rows[i] ? _mm512_loadu_si512((const void *)(rows[i] + g * 32))
                           : _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {  /* a lane's pairs 0,1 and 2,3 of rows 2i, 2i + 1 */
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) {  /* r[4i + k]: a lane's pair k of rows 4i .. 4i + 3 */
            r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int k = 0; k < 4; k++) {  /* pair 4L + k of all 16 rows: lane L of r[k + 4i] */
            const __m512i s0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
            const __m512i s1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
            const __m512i s2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
            const __m512i s3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
            uint32_t *o = kt + g * 256;
            _mm512_storeu_si512((void *)(o + k * 16), _mm512_shuffle_i32x4(s0, s2, 0x88));
            _mm512_storeu_si512((void *)(o + (4 + k) * 16), _mm512_shuffle_i32x4(s0, s2, 0xDD));
            _mm512_storeu_si512((void *)(o + (8 + k) * 16), _mm512_shuffle_i32x4(s1, s3, 0x88));
            _mm512_storeu_si512((void *)(o + (12 + k) * 16), _mm512_shuffle_i32x4(s1, s3, 0xDD));
        }
    }
}

/* 32 positions' values (rows[i]: position i's d values; NULL: zeros) as B tiles, vt [d / 16][16
 * pairs of positions][16 of d][2]: each pair of positions' values interleaved. */
static void value_tiles(const uint16_t *const *rows, int64_t d, uint16_t *vt) {
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
    for (int q = 0; q < 16; q++)
        for (int64_t cb = 0; cb < d / 16; cb++) {
            const uint16_t *even = rows[2 * q], *odd = rows[2 * q + 1];
            const __m256i a = even ? _mm256_loadu_si256((const __m256i *)(even + cb * 16))
                                   : _mm256_setzero_si256();
            const __m256i b = odd ? _mm256_loadu_si256((const __m256i *)(odd + cb * 16))
                                  : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512((void *)(vt + cb * 512 + q * 32),
                                _mm512_permutexvar_epi16(mix, both));
        }
}

/* paged_prompt's tiles (its arguments, bf16 queries and cache; d a multiple of 32). */
static int prompt_tiles(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *ctx_slots, int64_t start, int64_t num, uint16_t *out,
                        int64_t hq, int64_t hkv, int64_t d, int64_t num_slots, float scale) {
    const int64_t group = hq / hkv, ctx = start + num, np = (ctx + 31) / 32 * 32;
    const int64_t rows = num * group, blocks = (rows + 15) / 16;
    size_t bytes = (size_t)(hkv * np * d) * 2;
    uint16_t *kb = aligned_alloc(64, bytes), *vb = aligned_alloc(64, bytes);
    int failed = kb == NULL || vb == NULL ? 2 : 0;
    #pragma omp parallel if (num * ctx * hq * d >= (1 << 16))
    {
        #pragma omp for schedule(static)
        for (int64_t hb = 0; hb < hkv * (np / 32); hb++) {
            if (failed) continue;
            const int64_t h = hb / (np / 32), p0 = hb % (np / 32) * 32;
            const uint16_t *keys[32], *values[32];  /* each position's rows; NULL past ctx */
            for (int i = 0; i < 32; i++) {
                const int64_t at = p0 + i < ctx ? (h * num_slots + ctx_slots[p0 + i]) * d : -1;
                keys[i] = at < 0 ? NULL : k_cache + at;
                values[i] = at < 0 ? NULL : v_cache + at;
            }
            for (int half = 0; half < 2; half++)
                key_tiles(keys + 16 * half, d, (uint32_t *)(kb + (h * np + p0 + 16 * half) * d));
            value_tiles(values, d, vb + (h * np + p0) * d);
        }
        const size_t qbytes = (size_t)(16 * d) * 2, sbytes = (size_t)(16 * np) * 4;
        char *buf = aligned_alloc(64, qbytes + 2 * sbytes + (size_t)(16 * d) * 4);
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 2;
        }
        if (buf != NULL) configure_tiles(16);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < hkv * blocks; job++) {
            if (failed) continue;
            const int64_t h = job / blocks, r0 = job % blocks * 16;
            const int real = rows - r0 < 16 ? (int)(rows - r0) : 16;
            uint16_t *qa = (uint16_t *)buf, *pw = (uint16_t *)(buf + qbytes + sbytes);
            float *sc = (float *)(buf + qbytes), *os = (float *)(buf + qbytes + 2 * sbytes);
            int64_t len[16], at[16];
            for (int r = 0; r < 16; r++) {
                if (r < real) {
                    const int64_t t = (r0 + r) / group, g = (r0 + r) % group;
                    at[r] = t * hq + h * group + g;
                    len[r] = start + t + 1;
                    memcpy(qa + r * d, q + at[r] * d, (size_t)d * 2);
                } else {
                    memset(qa + r * d, 0, (size_t)d * 2);
                }
            }
            const int64_t npj = (len[real - 1] + 31) / 32 * 32;
            prompt_tile_rows(qa, real, len, npj, d, kb + h * np * d, vb + h * np * d, scale, sc,
                             pw, os);
            for (int r = 0; r < real; r++) store_row(out + at[r] * d, os + r * d, d, 1);
        }
        if (buf != NULL) _tile_release();
        free(buf);
    }
    free(kb);
    free(vb);
    return failed;
}
#endif

/* One sequence's prompt chunk: query t in [0, num) at position start + t attends over context
 * positions [0, start + t], whose cache slots are ctx_slots[0, start + num). q: [num, hq, d]
 * (`bf16`), scaled here; caches as paged_decode's; out: [num, hq * d]. The context's keys
 * (transposed) and values are read from the pool once, in fp32. A job is PROMPT_ROWS rows:
 * `heads` query heads (the largest of 4, 3, 2, 1 dividing the group) of one kv head for
 * PROMPT_ROWS / heads consecutive queries; a short last job repeats its last query, whose
 * copies are dropped. Each query's numbers depend on its own position only, so a prompt whole,
 * in chunks or after a prefix hit gives the same bits. Returns 2 if out of memory. */
int paged_prompt(const void *q, const void *k_cache, const void *v_cache,
                 const int64_t *ctx_slots, int64_t start, int64_t num, void *out, int64_t hq,
                 int64_t hkv, int64_t d, int64_t num_slots, double scale, int bf16,
                 int cache_bf16) {
    if (d > MAX_DIM || d % (2 * VL) || hq % hkv || start < 0 || num < 1) return 1;
#if defined(PROMPT_TILES)
    if (bf16 && cache_bf16 && d % 32 == 0 && packed_gemm_tiles(-1))
        return prompt_tiles(q, k_cache, v_cache, ctx_slots, start, num, out, hq, hkv, d,
                            num_slots, (float)scale);
#endif
    size_t es = bf16 ? 2 : 4, ces = cache_bf16 ? 2 : 4;
    int64_t group = hq / hkv, heads = group % 4 == 0 ? 4 : group % 3 == 0 ? 3
                                                           : group % 2 == 0 ? 2 : 1;
    int64_t per = PROMPT_ROWS / heads, blocks = (num + per - 1) / per, ctx = start + num;
    int64_t jobs = hkv * (group / heads) * blocks, ctxp = (ctx + 2 * VL - 1) / (2 * VL) * 2 * VL;
    float *kt = malloc((size_t)(hkv * d * ctxp) * sizeof(float));
    float *vg = malloc((size_t)(hkv * ctx * d) * sizeof(float));
    int failed = kt == NULL || vg == NULL ? 2 : 0;
    #pragma omp parallel if (num * ctx * hq * d >= (1 << 16))
    {
        float *sc = malloc((size_t)(2 * PROMPT_ROWS * ctxp) * sizeof(float));
        float *qs = malloc((size_t)(2 * PROMPT_ROWS * d) * sizeof(float)), *os = qs + PROMPT_ROWS * d;
        if (sc == NULL || qs == NULL) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(static)
        for (int64_t hp = 0; hp < hkv * ctxp; hp++) {
            if (kt == NULL || vg == NULL) continue;
            int64_t h = hp / ctxp, p = hp % ctxp;
            float key[MAX_DIM];
            if (p < ctx) {
                const char *row = (const char *)k_cache + (h * num_slots + ctx_slots[p]) * d * ces;
                load_row(key, row, d, cache_bf16);
                load_row(vg + (h * ctx + p) * d,
                         (const char *)v_cache + (h * num_slots + ctx_slots[p]) * d * ces, d, cache_bf16);
            } else {
                memset(key, 0, (size_t)d * sizeof(float));
            }
            for (int64_t c = 0; c < d; c++) kt[(h * d + c) * ctxp + p] = key[c];
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++) {
            if (sc == NULL || qs == NULL || kt == NULL || vg == NULL) continue;
            int64_t kh = job / (jobs / hkv), rest = job % (jobs / hkv);
            int64_t h0 = kh * group + rest / blocks * heads, t0 = rest % blocks * per;
            int64_t real = num - t0 < per ? num - t0 : per, lens[PROMPT_ROWS], at[PROMPT_ROWS];
            for (int64_t r = 0; r < PROMPT_ROWS; r++) {
                int64_t t = t0 + (r / heads < real ? r / heads : real - 1);
                at[r] = t * hq + h0 + r % heads;  /* the row's query head among q's rows */
                lens[r] = start + t + 1;
                load_scaled(qs + r * d, (const char *)q + at[r] * d * es, d, (float)scale, bf16);
            }
            prompt_rows(qs, lens, start + t0 + real, kt + kh * d * ctxp, ctxp, vg + kh * ctx * d,
                        d, sc, os);
            for (int64_t r = 0; r < real * heads; r++)
                store_row((char *)out + at[r] * d * es, os + r * d, d, bf16);
        }
        free(sc);
        free(qs);
    }
    free(kt);
    free(vg);
    return failed;
}
