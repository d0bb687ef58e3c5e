/* A mixture-of-experts layer's experts in one call (experts.py): the step's (token, slot)
 * pairs grouped by expert, each chosen expert's int4 gate|up and down projections run once over
 * its rows through the machine's int4 kernel (cpu_gemm.py's int4_gemm, passed in as a
 * function), its gated activation between them, and each token's k outputs summed in the order
 * of its slots. Experts no token chose are not read at all.
 *
 * A row's numbers are those of SparseMoE's modules, operation for operation and rounded as they
 * round: the kernel's rows are independent of each other, every other operation is per row, and
 * a token's sum runs over its own slots in a fixed order, so no result depends on which other
 * tokens share the step (batch invariance). Values are fp32 or bf16 (`bf16`); the kernel takes
 * bf16 or fp32 (`gemm_bf16`), and fp32 activations through a bf16 kernel are rounded to bf16 as
 * Int4Linear rounds them. Built with -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* int4_gemm's signature (avx512_gemm.c, avx2_gemm.c, amx_gemm.c). */
typedef int (*gemm_fn)(const void *x, const void *packed, void *y, void *xsum, int64_t m,
                       int64_t n, int64_t k, int64_t group, int64_t int8_from);

enum { ACT_SILU = 0, ACT_CLAMPED = 1 };

#define MAX_WIDTH 16384  /* the widest hidden size and expert width taken */

/* v rounded to the activations' dtype, as a PyTorch operator in that dtype rounds its result. */
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

/* The projection's output row (kernel dtype) in the activations' dtype, plus its bias. */
static void out_row(float *dst, const void *src, int64_t n, int gemm_bf16, const void *bias,
                    int bf16) {
    load_row(dst, src, n, gemm_bf16);
    if (bias == NULL) return;
    for (int64_t i = 0; i < n; i++) {
        float b = bf16 ? bf16_to_float(((const uint16_t *)bias)[i]) : ((const float *)bias)[i];
        dst[i] = rnd(dst[i] + b, bf16);
    }
}

/* The gated activation of row g|u (2 * inter values) into a (inter values), as the modules
 * compute it: silu(g) * u (MLP.glu), or gpt-oss's (ClampedExpert.glu):
 * (clamp(u, -limit, limit) + 1) * (g' * sigmoid(g' * alpha)), g' = min(g, limit). */
static void activate(float *a, const float *gu, int64_t inter, int act, float limit,
                     float alpha, int bf16) {
    const float *g = gu, *u = gu + inter;
    for (int64_t i = 0; i < inter; i++) {
        if (act == ACT_SILU) {
            float s = rnd(g[i] / (1.0f + expf(-g[i])), bf16);
            a[i] = rnd(s * u[i], bf16);
        } else {
            float gc = g[i] > limit ? limit : g[i];
            float uc = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
            float z = rnd(gc * alpha, bf16);
            float sig = rnd(1.0f / (1.0f + expf(-z)), bf16);
            float glu = rnd(gc * sig, bf16);
            a[i] = rnd(rnd(uc + 1.0f, bf16) * glu, bf16);
        }
    }
}

typedef struct {
    gemm_fn gemm;
    int gemm_bf16, bf16, act;
    int64_t h, inter, group, gu_int8_from, down_int8_from;
    float limit, alpha;
} Experts;

/* Expert e over its n pairs (`pairs`, token * k + slot): rows of x gathered, gate|up, the
 * activation, down, each pair's output row into pair_out (activations' dtype). */
static int run_expert(const Experts *s, const void *x, int64_t k, const int64_t *pairs,
                      int64_t n, const void *gate_up, const void *down, const void *gu_bias,
                      const void *down_bias, char *scratch, void *pair_out) {
    size_t es = s->bf16 ? 2 : 4, ges = s->gemm_bf16 ? 2 : 4;
    int64_t h = s->h, i2 = 2 * s->inter, wide = h > i2 ? h : i2;
    char *xg = scratch, *gu = xg + n * wide * ges;
    float *xsum = (float *)(gu + n * wide * ges);
    #pragma omp parallel for schedule(static) if (n >= 8)
    for (int64_t r = 0; r < n; r++) {
        float row[MAX_WIDTH];
        load_row(row, (const char *)x + (pairs[r] / k) * h * es, h, s->bf16);
        store_row(xg + r * h * ges, row, h, s->gemm_bf16);
    }
    if (s->gemm(xg, gate_up, gu, xsum, n, i2, h, s->group, s->gu_int8_from)) return 1;
    #pragma omp parallel for schedule(static) if (n >= 8)
    for (int64_t r = 0; r < n; r++) {
        float g[2 * MAX_WIDTH], a[MAX_WIDTH];
        out_row(g, gu + r * i2 * ges, i2, s->gemm_bf16, gu_bias, s->bf16);
        activate(a, g, s->inter, s->act, s->limit, s->alpha, s->bf16);
        store_row(xg + r * s->inter * ges, a, s->inter, s->gemm_bf16);
    }
    if (s->gemm(xg, down, gu, xsum, n, h, s->inter, s->group, s->down_int8_from)) return 1;
    #pragma omp parallel for schedule(static) if (n >= 8)
    for (int64_t r = 0; r < n; r++) {
        float d[MAX_WIDTH];
        out_row(d, gu + r * h * ges, h, s->gemm_bf16, down_bias, s->bf16);
        store_row((char *)pair_out + pairs[r] * h * es, d, h, s->bf16);
    }
    return 0;
}

/* y[t] = sum over its slots j in order of pair_out[t, j] * weights[t, j], each product and
 * each partial sum rounded to the dtype (SparseMoE.forward's sum). */
static void combine(const void *pair_out, const void *weights, void *y, int64_t t, int64_t k,
                    int64_t h, int bf16) {
    size_t es = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (t >= 8)
    for (int64_t r = 0; r < t; r++) {
        float acc[MAX_WIDTH], o[MAX_WIDTH], w[1];
        for (int64_t j = 0; j < k; j++) {
            load_row(o, (const char *)pair_out + (r * k + j) * h * es, h, bf16);
            load_row(w, (const char *)weights + (r * k + j) * es, 1, bf16);
            for (int64_t i = 0; i < h; i++) {
                float p = rnd(o[i] * w[0], bf16);
                acc[i] = j == 0 ? p : rnd(acc[i] + p, bf16);
            }
        }
        store_row((char *)y + r * h * es, acc, h, bf16);
    }
}

/* x [t, h] and y [t, h] (dtype `bf16`); experts: int64 [t, k], each token's chosen experts,
 * weights [t, k] (x's dtype) their weights; gate_up[e] / down[e]: expert e's packed int4
 * weights ([2 * inter, h] and [h, inter]), gu_bias[e] / down_bias[e] its biases (x's dtype) or
 * NULL arrays. Returns 0, or 1 for what it does not take (nothing written then but y). */
int moe_int4(void *gemm, int gemm_bf16, const void *x, void *y, int64_t t, int64_t k,
             const int64_t *experts, const void *weights, int64_t num_experts,
             const void *const *gate_up, const void *const *down, const void *const *gu_bias,
             const void *const *down_bias, int64_t h, int64_t inter, int64_t group,
             int64_t gu_int8_from, int64_t down_int8_from, int act, float limit, float alpha,
             int bf16) {
    if (h > MAX_WIDTH || inter > MAX_WIDTH || (act != ACT_SILU && act != ACT_CLAMPED))
        return 1;
    int64_t pairs = t * k;
    for (int64_t p = 0; p < pairs; p++)
        if (experts[p] < 0 || experts[p] >= num_experts) return 1;
    int64_t *start = calloc((size_t)num_experts + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(pairs ? pairs : 1) * sizeof(int64_t));
    size_t es = bf16 ? 2 : 4;
    void *pair_out = malloc((size_t)(pairs ? pairs : 1) * (size_t)h * es);
    int failed = start == NULL || order == NULL || pair_out == NULL;
    int64_t most = 0;
    if (!failed) {  /* counting sort: pairs by expert, in pair order within one */
        for (int64_t p = 0; p < pairs; p++) start[experts[p] + 1]++;
        for (int64_t e = 0; e < num_experts; e++) {
            most = start[e + 1] > most ? start[e + 1] : most;
            start[e + 1] += start[e];
        }
        int64_t *fill = calloc((size_t)num_experts, sizeof(int64_t));
        failed = fill == NULL;
        for (int64_t p = 0; !failed && p < pairs; p++)
            order[start[experts[p]] + fill[experts[p]]++] = p;
        free(fill);
    }
    int64_t wide = h > 2 * inter ? h : 2 * inter;
    char *scratch = failed ? NULL : malloc((size_t)(most ? most : 1) * (size_t)wide * 8
                                           + (size_t)(most ? most : 1) * (size_t)wide * 4);
    failed = failed || scratch == NULL;
    Experts s = {(gemm_fn)gemm, gemm_bf16, bf16, act, h, inter, group, gu_int8_from,
                 down_int8_from, limit, alpha};
    for (int64_t e = 0; !failed && e < num_experts; e++) {
        int64_t n = start[e + 1] - start[e];
        if (n)
            failed = run_expert(&s, x, k, order + start[e], n, gate_up[e], down[e],
                                gu_bias ? gu_bias[e] : NULL, down_bias ? down_bias[e] : NULL,
                                scratch, pair_out);
    }
    if (!failed) combine(pair_out, weights, y, t, k, h, bf16);
    free(scratch);
    free(pair_out);
    free(order);
    free(start);
    return failed;
}
