/* Unquantized layers' generated rows: y [m, n] = x [m, k] @ w [n, k]^T, reading the layer's own
 * weight in place (row-major, as nn.Linear holds it); built into one library with layer_ops.c
 * (layer_ops.py).
 *
 * At a few rows PyTorch's GEMM in fixed tiles of 16 rows (rows.py) streamed a bf16 weight at
 * 4-11 GB/s: oneDNN reorders the weight on every call. Here a row's output n is one dot product
 * over k in VL lanes (vdpbf16ps on pairs where x and w are bf16 and the CPU has AVX-512 BF16,
 * fp32 fused multiply-adds otherwise), the lanes of VL consecutive outputs then summed by one
 * fixed tree (sum_lanes): the same instructions for a row whatever rows share the call, so rows
 * are independent. Blocks of DENSE_ROWS rows x DENSE_COLS outputs share their loads. */

#include <stdint.h>
#include <string.h>

#include "common.h"
#include "vectors.h"

#if defined(__AVX512BF16__)
#define DENSE_ROWS 6 /* 24 accumulators of 32 */
#else
#define DENSE_ROWS 3 /* 12 of 16 (AVX2): the weights' 4 vectors take the rest */
#endif
#define DENSE_COLS 4

/* Rows [0, R) of x against outputs [n0, n0 + VL) of w: part[r][j] holds the lanes of output
 * n0 + j for row r, summed over k in order. `dp`: x and w bf16, pairs through vdpbf16ps. */
static inline __attribute__((always_inline)) void dense_block(
        const char *x, const char *w, int64_t k, int64_t n0, const int R, int x_bf16,
        int w_bf16, const int dp, vf part[DENSE_ROWS][VL]) {
    size_t xes = x_bf16 ? 2 : 4, wes = w_bf16 ? 2 : 4;
    for (int c0 = 0; c0 < VL; c0 += DENSE_COLS) {
        vf acc[R][DENSE_COLS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < DENSE_COLS; c++) acc[r][c] = (vf){0};
        const char *wr = w + (n0 + c0) * k * wes;
        if (dp) {
#if defined(__AVX512BF16__)
            for (int64_t i = 0; i < k; i += 2 * VL) {
                __m512i wv[DENSE_COLS];
                for (int c = 0; c < DENSE_COLS; c++)
                    wv[c] = _mm512_loadu_si512(wr + (c * k + i) * 2);
                for (int r = 0; r < R; r++) {
                    __m512i xv = _mm512_loadu_si512(x + (r * k + i) * 2);
                    for (int c = 0; c < DENSE_COLS; c++)
                        acc[r][c] = (vf)_mm512_dpbf16_ps((__m512)acc[r][c], (__m512bh)xv,
                                                         (__m512bh)wv[c]);
                }
            }
#endif
        } else {
            for (int64_t i = 0; i < k; i += VL) {
                vf wv[DENSE_COLS];
                for (int c = 0; c < DENSE_COLS; c++) wv[c] = loadv(wr + (c * k + i) * wes, w_bf16);
                for (int r = 0; r < R; r++) {
                    vf xv = loadv(x + (r * k + i) * xes, x_bf16);
                    for (int c = 0; c < DENSE_COLS; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < DENSE_COLS; c++) part[r][c0 + c] = acc[r][c];
    }
}

/* x: [m, k] (`x_bf16`), w: [n, k] (`w_bf16`), y: [m, n] in x's dtype (bf16 rounded to nearest
 * even), or fp32 where `y_f32` (logits). n a multiple of VL and k of 2 * VL, else 1 (nothing
 * written). */
int dense_gemm(const void *x, const void *w, void *y, int64_t m, int64_t n, int64_t k,
               int x_bf16, int w_bf16, int y_f32) {
    if (n % VL || k % (2 * VL) || m < 0) return 1;
#if defined(__AVX512BF16__)
    const int dp = x_bf16 && w_bf16;
#else
    const int dp = 0;
#endif
    size_t xes = x_bf16 ? 2 : 4, yes = x_bf16 && !y_f32 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (m * n * k >= (1 << 18))
    for (int64_t g = 0; g < n / VL; g++) {
        vf part[DENSE_ROWS][VL];
        for (int64_t r0 = 0; r0 < m; r0 += DENSE_ROWS) {
            int64_t rows = m - r0 < DENSE_ROWS ? m - r0 : DENSE_ROWS;
            const char *xr = (const char *)x + r0 * k * xes;
#define DENSE(R)                                                                          \
    do {                                                                                  \
        if (dp)                                                                           \
            dense_block(xr, (const char *)w, k, g * VL, R, x_bf16, w_bf16, 1, part);      \
        else                                                                              \
            dense_block(xr, (const char *)w, k, g * VL, R, x_bf16, w_bf16, 0, part);      \
    } while (0)
            switch (rows) {
                case 1: DENSE(1); break;
                case 2: DENSE(2); break;
#if DENSE_ROWS == 6
                case 3: DENSE(3); break;
                case 4: DENSE(4); break;
                case 5: DENSE(5); break;
#endif
                default: DENSE(DENSE_ROWS); break;
            }
#undef DENSE
            for (int64_t r = 0; r < rows; r++) {
                float out[VL];
                vf s = sum_lanes(part[r]);
                memcpy(out, &s, sizeof out);
                store_row((char *)y + ((r0 + r) * n + g * VL) * yes, out, VL, yes == 2);
            }
        }
    }
    return 0;
}
