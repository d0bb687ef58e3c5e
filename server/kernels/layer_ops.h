/* The layer operations' entry points that decode_step.c calls (layer_ops.c, paged_attention.c,
 * dense_gemm.c, built into one library): declared once here and included where they are
 * defined too, so that a change of signature fails to compile instead of calling wrongly.
 * layer_ops.py's _SIGNATURES are their ctypes side. */
#ifndef LOCALSERVE_LAYER_OPS_H
#define LOCALSERVE_LAYER_OPS_H
#include <stdint.h>

int rms_norm(const void *x, const void *weight, void *out, int64_t t, int64_t h, double eps,
             int bf16);
int rope_store(const void *qkv, int64_t t, int64_t row_stride, int64_t hq, int64_t hkv,
               int64_t d, const float *cos_t, const float *sin_t, const int64_t *positions,
               const int64_t *slots, void *q_out, void *k_cache, void *v_cache,
               int64_t num_slots, int bf16, int cache_bf16, const void *q_norm,
               const void *k_norm, double eps);
int paged_decode(const void *q, const void *k_cache, const void *v_cache,
                 const int64_t *ctx_slots, const int64_t *lens, void *out, int64_t b,
                 int64_t hq, int64_t hkv, int64_t d, int64_t max_ctx, int64_t num_slots,
                 double scale, int bf16, int cache_bf16);
int dense_gemm(const void *x, const void *w, void *y, int64_t m, int64_t n, int64_t k,
               int x_bf16, int w_bf16, int y_f32);
int packed_gemm(const void *x, const void *w, void *y, int64_t m, int64_t n, int64_t k,
                int y_f32);
int packed_gemm_tiles(int on);
#endif
