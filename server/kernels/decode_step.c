/* A whole decode step through the decoder layers in one call (decode_plan.py), and the gated
 * MLP's activation that the modules and the step share (act_mul).
 *
 * At one sequence a 135M model's layers are ~300 kernel calls a step, each ~10 us of work: the
 * Python between them (ctypes' argument conversion, the residual adds and the activation as
 * PyTorch operators, each a few microseconds) took as long again. decode_step runs the same
 * kernels in the same order on the same buffers (layer_ops.c, paged_attention.c, dense_gemm.c
 * here; the int4/int8 GEMMs of the kind cpu_gemm picked through the pointers it is handed), and
 * does the residual adds, the query scale and the activation as the modules do them (below), so
 * a row's numbers are the modules' bit for bit: steps that mix prompt rows in, which run the
 * modules, agree with it, and batch invariance holds.
 *
 * Built into one library with layer_ops.c (layer_ops.py: SOURCES), -ffp-contract=off. */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "layer_ops.h"
#include "vectors.h"

#define CHUNK 256  /* values of a row the element-wise operations take at a time */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* silu(g) = g / (1 + e^-g), as g e^g / (1 + e^g) where g < 0 (e^-|g| never overflows);
 * gelu_tanh(g) = g (1 + tanh(u)) / 2, u = sqrt(2 / pi) (g + 0.044715 g^3), tanh(|u|) =
 * (1 - e^-2|u|) / (1 + e^-2|u|). exp_negv: within 2 ulp of e^x; each lane on its own. */
static inline vf activation(vf g, int kind) {
    vf zero = {0};
    i32v neg = g < zero;
    if (kind == ACT_SILU) {
        vf a = (vf)((neg & (i32v)g) | (~neg & (i32v)(zero - g)));  /* -|g| */
        vf e = exp_negv(a), ge = g * e;  /* one division: the numerator picked first */
        return (vf)((neg & (i32v)ge) | (~neg & (i32v)g)) / (e + 1.0f);
    }
    vf u = (g + g * g * g * 0.044715f) * 0.7978845608028654f;
    i32v uneg = u < zero;
    vf a = (vf)((uneg & (i32v)u) | (~uneg & (i32v)(zero - u)));  /* -|u| */
    vf e = exp_negv(a * 2.0f);
    vf th = (1.0f - e) / (1.0f + e);  /* tanh(|u|) */
    th = (vf)((uneg & (i32v)(zero - th)) | (~uneg & (i32v)th));
    return g * (th + 1.0f) * 0.5f;
}

/* One row's out[i] = act(gate[i]) * up[i], n values: each rounded to the dtype as PyTorch's
 * act(gate) * up rounds them (the activation's result, then the product). */
static void act_row(const char *gate, const char *up, char *out, int64_t n, int kind, int bf16) {
    size_t es = bf16 ? 2 : 4;
    float g[CHUNK], u[CHUNK];
    uint16_t gr[CHUNK];
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t len = n - c < CHUNK ? n - c : CHUNK;
        load_row(g, gate + c * es, len, bf16);
        load_row(u, up + c * es, len, bf16);
        for (int64_t i = 0; i < len; i += VL) {
            int64_t count = len - i < VL ? len - i : VL;
            store_lanes(g + i, activation(load_lanes(g + i, count), kind), count);
        }
        if (bf16) {  /* the activation's result rounded, as a bf16 operator's */
            store_row(gr, g, len, 1);
            load_row(g, gr, len, 1);
        }
        for (int64_t i = 0; i < len; i++) g[i] = g[i] * u[i];
        store_row(out + c * es, g, len, bf16);
    }
}

/* out [t, n] (contiguous) = act(gate) * up for t rows; gate and up rows `gate_stride` and
 * `up_stride` values apart (halves of one fused projection's rows). 1: an unknown kind. */
int act_mul(const void *gate, const void *up, void *out, int64_t t, int64_t n,
            int64_t gate_stride, int64_t up_stride, int kind, int bf16) {
    if (kind != ACT_SILU && kind != ACT_GELU_TANH) return 1;
    size_t es = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (t * n >= (1 << 15))
    for (int64_t r = 0; r < t; r++)
        act_row((const char *)gate + r * gate_stride * es, (const char *)up + r * up_stride * es,
                (char *)out + r * n * es, n, kind, bf16);
    return 0;
}

/* x += branch * multiplier for n values, as PyTorch's branch.mul_(multiplier) (skipped at 1)
 * and x.add_(branch) round them in the dtype. */
static void add_residual(char *x, char *branch, int64_t n, double multiplier, int bf16) {
    float xs[CHUNK], bs[CHUNK];
    size_t es = bf16 ? 2 : 4;
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t len = n - c < CHUNK ? n - c : CHUNK;
        load_row(xs, x + c * es, len, bf16);
        load_row(bs, branch + c * es, len, bf16);
        if (multiplier != 1.0) {
            for (int64_t i = 0; i < len; i++) bs[i] = bs[i] * (float)multiplier;
            store_row(branch + c * es, bs, len, bf16);
            load_row(bs, branch + c * es, len, bf16);
        }
        for (int64_t i = 0; i < len; i++) xs[i] = xs[i] + bs[i];
        store_row(x + c * es, xs, len, bf16);
    }
}

/* A projection as decode_plan.py's _Layer holds it. */
enum { PROJ_INT4 = 0, PROJ_INT8 = 1, PROJ_PACKED = 2, PROJ_DENSE = 3 };
struct proj {
    int64_t kind;
    const void *w;      /* int4: the packed nibbles; int8: q8; packed / dense: the weight */
    const void *scale;  /* int8's per-output scales */
    int64_t group, int8_from, w_bf16;
};

struct layer {
    const void *norm1, *norm2, *post_attn, *post_ffn, *q_norm, *k_norm;  /* NULL: none */
    struct proj qkv, o, gate_up, down;
    int64_t rope;    /* which of the step's rope tables */
    int64_t window;  /* which of the step's attention contexts */
};

typedef int (*gemm4_fn)(const void *, const void *, void *, float *, int64_t, int64_t, int64_t,
                        int64_t, int64_t);
typedef int (*gemm8_fn)(const void *, const void *, const void *, void *, int64_t, int64_t,
                        int64_t, int);
typedef int (*gemm8_f32_fn)(const void *, const void *, const void *, void *, int64_t, int64_t,
                            int64_t);

/* One step's sizes, buffers and inputs (decode_plan.py fills it). */
struct step {
    int64_t t, h, inter, hq, hkv, d, bf16, cache_bf16, act;
    int64_t widen;  /* fp32 rows through int4/int8 kernels that take bf16: xb, yb the copies */
    double eps, scale, residual_multiplier;
    void *x, *normed, *proj, *qkv, *q, *att, *gu, *actv, *xb, *yb;
    float *xsum;
    const void *query_scale;  /* [t] in the dtype, or NULL */
    const float *cos[3], *sin[3];
    const int64_t *positions[3];
    const int64_t *slots[2], *ctx[2], *lens[2];
    int64_t max_ctx[2];
    void *const *caches;       /* per layer: its k and v pools */
    const int64_t *num_slots;  /* per layer */
    gemm4_fn int4;
    const void *int8;    /* gemm8_fn, or gemm8_f32_fn where int8_f32 */
    int64_t int8_f32;
};

/* y [t, n] = x [t, k] through one projection: the call its module makes for these rows. */
static int project(const struct step *s, const struct proj *p, const void *x, void *y,
                   int64_t n, int64_t k) {
    int64_t t = s->t;
    if (p->kind == PROJ_PACKED) return packed_gemm(x, p->w, y, t, n, k, 0);
    if (p->kind == PROJ_DENSE) return dense_gemm(x, p->w, y, t, n, k, (int)s->bf16,
                                                 (int)p->w_bf16, 0);
    const void *xin = x;
    void *yout = y;
    if (s->widen) {  /* x rounded to bf16, the bf16 result widened: as int4.py, int8.py */
        store_row(s->xb, (const float *)x, t * k, 1);
        xin = s->xb, yout = s->yb;
    }
    int failed;
    if (p->kind == PROJ_INT4)
        failed = s->int4(xin, p->w, yout, s->xsum, t, n, k, p->group, p->int8_from);
    else if (s->int8_f32)
        failed = ((gemm8_f32_fn)s->int8)(xin, p->w, p->scale, yout, t, n, k);
    else
        failed = ((gemm8_fn)s->int8)(xin, p->w, p->scale, yout, t, n, k, 0);
    if (s->widen) load_row((float *)y, s->yb, t * n, 1);
    return failed;
}

/* The attention half of a layer: norm, q|k|v, rotary embedding and cache write, attention,
 * output projection, residual. */
static int attention(const struct step *s, const struct layer *la, void *k_cache,
                     void *v_cache, int64_t num_slots) {
    int64_t t = s->t, h = s->h, nq = s->hq * s->d, nkv = s->hkv * s->d, w = la->window;
    int bf16 = (int)s->bf16;
    size_t es = bf16 ? 2 : 4;
    int failed = rms_norm(s->x, la->norm1, s->normed, t, h, s->eps, bf16);
    failed |= project(s, &la->qkv, s->normed, s->qkv, nq + 2 * nkv, h);
    failed |= rope_store(s->qkv, t, nq + 2 * nkv, s->hq, s->hkv, s->d, s->cos[la->rope],
                         s->sin[la->rope], s->positions[la->rope], s->slots[w], s->q, k_cache,
                         v_cache, num_slots, bf16, (int)s->cache_bf16, la->q_norm, la->k_norm,
                         s->eps);
    if (s->query_scale != NULL)  /* q * query_scale, rounded as the module's product */
        for (int64_t i = 0; i < t; i++) {
            float qs[1], row[CHUNK];
            load_row(qs, (const char *)s->query_scale + i * es, 1, bf16);
            for (int64_t c = 0; c < nq; c += CHUNK) {
                int64_t len = nq - c < CHUNK ? nq - c : CHUNK;
                char *at = (char *)s->q + (i * nq + c) * es;
                load_row(row, at, len, bf16);
                for (int64_t j = 0; j < len; j++) row[j] = row[j] * qs[0];
                store_row(at, row, len, bf16);
            }
        }
    failed |= paged_decode(s->q, k_cache, v_cache, s->ctx[w], s->lens[w], s->att, t, s->hq,
                           s->hkv, s->d, s->max_ctx[w], num_slots, s->scale, bf16,
                           (int)s->cache_bf16);
    failed |= project(s, &la->o, s->att, s->proj, h, nq);
    if (la->post_attn != NULL)  /* in place: rms_norm reads a row before writing it */
        failed |= rms_norm(s->proj, la->post_attn, s->proj, t, h, s->eps, bf16);
    add_residual((char *)s->x, (char *)s->proj, t * h, s->residual_multiplier, bf16);
    return failed;
}

/* The MLP half: norm, gate|up, act(gate) * up, down, residual. */
static int mlp(const struct step *s, const struct layer *la) {
    int64_t t = s->t, h = s->h, i = s->inter;
    int bf16 = (int)s->bf16;
    size_t es = bf16 ? 2 : 4;
    int failed = rms_norm(s->x, la->norm2, s->normed, t, h, s->eps, bf16);
    failed |= project(s, &la->gate_up, s->normed, s->gu, 2 * i, h);
    failed |= act_mul(s->gu, (const char *)s->gu + i * es, s->actv, t, i, 2 * i, 2 * i,
                      (int)s->act, bf16);
    failed |= project(s, &la->down, s->actv, s->proj, h, i);
    if (la->post_ffn != NULL)
        failed |= rms_norm(s->proj, la->post_ffn, s->proj, t, h, s->eps, bf16);
    add_residual((char *)s->x, (char *)s->proj, t * h, s->residual_multiplier, bf16);
    return failed;
}

/* x [t, h] (the embeddings) through n layers in place. Nonzero: a kernel declined (the plan
 * checked every shape when it was built, so this is an error, not a fallback). */
int decode_step(const struct step *s, const struct layer *layers, int64_t n) {
    int failed = 0;
    for (int64_t l = 0; l < n; l++) {
        failed |= attention(s, &layers[l], s->caches[2 * l], s->caches[2 * l + 1],
                            s->num_slots[l]);
        failed |= mlp(s, &layers[l]);
    }
    return failed;
}
