/* The small per-layer operations of a decoder step, each in one pass (layer_ops.py calls them).
 *
 * In PyTorch each of these is 6-25 operator calls of a few microseconds each at decode sizes:
 * at one sequence they were most of a 135M model's step. Every function computes a row (a
 * token, or a query head) with a fixed sequence of instructions that depends on that row's own
 * sizes only, never on how many rows share the call, so results are batch invariant.
 *
 * Built into one library with paged_attention.c and dense_gemm.c (layer_ops.py: SOURCES).
 *
 * Values are fp32 or bf16 (flag `*_bf16`); arithmetic is fp32, bf16 results are rounded to
 * nearest even. Built with -ffp-contract=off: no fused multiply-adds, the same results wherever
 * the compiler vectorizes. Sums over a vector run in 16 interleaved lanes added pairwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "layer_ops.h"
#include "vectors.h"

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

#define MAX_HIDDEN 16384  /* the widest row rms_norm takes */

/* One row of n values normalized in place as the reference implementation does it:
 * normalize in fp32, round to the dtype (`bf16`), scale by the weights w (fp32 copies of the
 * dtype's values), the result rounded to the dtype. */
static inline void norm_row(float *x, const float *w, int64_t n, double eps, int bf16) {
    float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + (float)eps);
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] * inv;
        if (bf16) v = bf16_to_float(float_to_bf16(v));
        v = w[i] * v;
        x[i] = bf16 ? bf16_to_float(float_to_bf16(v)) : v;
    }
}

/* RMSNorm of t rows of h values: y = weight * round(x / rms(x)) (norm_row). */
int rms_norm(const void *x, const void *weight, void *out, int64_t t, int64_t h, double eps,
             int bf16) {
    if (h > MAX_HIDDEN) return 1;
    #pragma omp parallel for schedule(static) if (t >= 8)
    for (int64_t r = 0; r < t; r++) {
        float row[MAX_HIDDEN], w[MAX_HIDDEN];
        size_t es = bf16 ? 2 : 4;
        load_row(row, (const char *)x + r * h * es, h, bf16);
        load_row(w, weight, h, bf16);
        norm_row(row, w, h, eps, bf16);
        store_row((char *)out + r * h * es, row, h, bf16);
    }
    return 0;
}

/* Rotary embedding and cache write for t tokens of a fused q|k|v projection.
 * qkv: [t, row_stride] (q heads first, then k, then v, each head d wide), dtype `bf16`;
 * cos/sin: fp32 [max_pos, d] tables; q_out: [t, hq, d] roped queries, dtype `bf16`;
 * k_cache/v_cache: [hkv, num_slots, d], dtype `cache_bf16`; token i's k (roped) and v go to
 * slot slots[i]. Rotation as rotate_half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
 * q_norm/k_norm (d weights, dtype `bf16`; NULL: none): each q and k head is RMS-normalized
 * first (Qwen3, Gemma 3), with the bits rms_norm gives the row. */
int rope_store(const void *qkv, int64_t t, int64_t row_stride, int64_t hq, int64_t hkv,
               int64_t d, const float *cos_t, const float *sin_t, const int64_t *positions,
               const int64_t *slots, void *q_out, void *k_cache, void *v_cache,
               int64_t num_slots, int bf16, int cache_bf16, const void *q_norm,
               const void *k_norm, double eps) {
    if (d % 2 || d > MAX_DIM) return 1;
    size_t es = bf16 ? 2 : 4, ces = cache_bf16 ? 2 : 4;
    int64_t half = d / 2, heads = hq + 2 * hkv;
    #pragma omp parallel for schedule(static) if (t * heads >= 256)
    for (int64_t job = 0; job < t * heads; job++) {
        int64_t i = job / heads, h = job % heads;
        float x[MAX_DIM], y[MAX_DIM];
        const float *c = cos_t + positions[i] * d, *s = sin_t + positions[i] * d;
        load_row(x, (const char *)qkv + (i * row_stride + h * d) * es, d, bf16);
        const void *norm = h < hq ? q_norm : h < hq + hkv ? k_norm : NULL;
        if (norm != NULL) {  /* Qwen3's and Gemma's per-head RMSNorm, as rms_norm does it */
            load_row(y, norm, d, bf16);
            norm_row(x, y, d, eps, bf16);
        }
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

/* out[r] = the index of row r's greatest value (x: fp32 [t, n]), the first of equal ones; a NaN
 * wins (the first), as PyTorch's max(dim=-1).indices: the greatest by lanes, then the first
 * position that holds it. */
int argmax_rows(const float *x, int64_t t, int64_t n, int64_t *out) {
    if (n < 1) return 1;
    #pragma omp parallel for schedule(static) if (t * n >= (1 << 17))
    for (int64_t r = 0; r < t; r++) {
        const float *row = x + r * n;
        float best = row[0];
        int nan = best != best;
        int64_t i = 0;
        if (n >= VL) {
            vf m, v;
            i32v seen = {0};
            memcpy(&m, row, sizeof m);
            for (i = 0; i + VL <= n; i += VL) {
                memcpy(&v, row + i, sizeof v);
                seen |= v != v;
                m = vmax(m, v);
            }
            float lane[VL];
            int32_t flags[VL];
            memcpy(lane, &m, sizeof lane);
            memcpy(flags, &seen, sizeof flags);
            for (int l = 0; l < VL; l++) {
                best = lane[l] > best ? lane[l] : best;
                nan |= flags[l] != 0;
            }
        }
        for (; i < n; i++) {
            best = row[i] > best ? row[i] : best;
            nan |= row[i] != row[i];
        }
        int64_t at = 0;
        while (at < n && (nan ? row[at] == row[at] : row[at] != best)) at++;
        out[r] = at;
    }
    return 0;
}
