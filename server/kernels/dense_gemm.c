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

#define _GNU_SOURCE /* syscall() in unistd.h under -std=c11 (AMX state, below) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "amx_tiles.h"
#include "common.h"
#include "layer_ops.h"
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

/* Unquantized bf16 layers on CPUs with AVX-512 BF16, every row (prompt and generated alike):
 * y [m, n] = x [m, k] @ w^T, the weight packed once at load (layer_ops.pack_weight) as
 * [n / 16][k / 2][16][2]: for each block of 16 outputs, each pair of inputs' 16 weight pairs
 * lie in one vector, so one vdpbf16ps adds a row's pair of inputs times them to the row's 16
 * outputs, no lane sums after. A pass holds ROWS_P rows x 3 blocks (48 outputs) in 24
 * accumulators, each row's input pair broadcast once for the 3; every output of a row is its
 * pairs summed in order, the same instructions whatever rows share the call, so rows never
 * depend on each other. Zen 5, 2 cores, weights in cache: 1536 x 576 at 32 rows 775 GFLOP/s
 * (dense_gemm: 442; oneDNN's GEMM in tiles of 32 rows: 588), at 128 1034 (469; 873 in tiles of
 * 128). */
#define ROWS_P 8

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void packed_block(
        const uint32_t *x, int64_t pairs, const uint16_t *w, int64_t block, void *y,
        int64_t n, const int R, const int C, int y_f32, int first) {
    __m512 acc[ROWS_P][3];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i wv[3];
        for (int c = 0; c < C; c++) {
            const uint16_t *wp = w + c * block + p * 32;
            if (first) ahead(wp, 64);
            wv[c] = _mm512_loadu_si512(wp);
        }
        for (int r = 0; r < R; r++) {
            __m512i xb = _mm512_set1_epi32((int)x[r * pairs + p]);
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xb, (__m512bh)wv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            if (y_f32)
                _mm512_storeu_ps((float *)y + r * n + c * 16, acc[r][c]);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * n + c * 16),
                                    (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
        }
}
#endif

/* On CPUs with AMX (Intel Sapphire Rapids on), once packed_gemm_tiles(1) is granted: the same
 * packed weight is AMX's own B-tile order (16 input pairs x 16 outputs x 2 in 1 KB), so a
 * chunk of 32 inputs is one tile load a block of 16 outputs, and one TDPBF16PS adds 16 rows x
 * 16 outputs x 32 inputs. Tiles 0-3 hold the sums (row tile t, output block h at 2t + h), 4-5
 * rows of x, 6-7 weights; a pass is 32 rows x 32 outputs. Each output's sum is its chunks in
 * order, each chunk's 16 pairs in the instruction's fixed order, whatever rows share the tile
 * (tile rows are computed independently; a call of fewer than 16 rows sets its tiles to that
 * many rows, which changes no row's sums), so rows stay independent. Layers whose k is not a
 * multiple of 32 take the vdpbf16ps passes above, at every row count. */
#if defined(__AVX512BF16__) && defined(AMX_TILES) && defined(__AMX_BF16__)
#define PACKED_TILES 1
#ifndef AHEAD_T
#define AHEAD_T 64 /* inputs ahead: 1.0-1.3x at 1-32 rows, noisy */
#endif

/* Prompt-sized calls (more than one pass of 32 rows) over more than TILES_WIDE inputs go in
 * chunks of TILES_KC inputs, TILES_NC pairs of output blocks at a time, each pass's sums stored
 * between chunks (fp32 tiles to memory and back: the same sums), so that a chunk's weights stay
 * in L2 for every pass and its rows for every pair; whole-k passes, pair by pair, read every
 * row again for each pair from beyond L2 once the rows outgrow it. Intel Xeon with AMX,
 * 2026-12-06, per call, the two taking turns: 512 x 8192 inputs x 2048 outputs 1.1-1.37x;
 * 2048 inputs 0.96-1.08x, 576 and 1536 0.88-0.92x (there whole-k passes keep a pair's
 * weights in L1), so they keep whole-k passes. */
#define TILES_KC 512
#define TILES_NC 8
#define TILES_WIDE 2048

/* Rows [0, r) (r <= 32, row stride k) of xp, inputs [c0, c1), against one or two blocks of 16
 * outputs (w1 NULL: one), each block's packed weight [k / 2][16][2]; the sums go on from
 * `sums` (4 tiles of 16 x 16 fp32: row tile t, block h at 2t + h) where `more`, else from
 * zero, and are stored back there. */
static void tiles_pass(const uint16_t *xp, int64_t k, int64_t c0, int64_t c1,
                       const uint16_t *w0, const uint16_t *w1, float (*sums)[16][16], int more,
                       int r, int first) {
    const int two = r > 16;
    if (more) {  /* the tiles this pass stored */
        tile_load(0, sums[0], 64);
        if (w1) tile_load(1, sums[1], 64);
        if (two) {
            tile_load(2, sums[2], 64);
            if (w1) tile_load(3, sums[3], 64);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t c = c0; c < c1; c += 32) {
        if (AHEAD_T && first && c + AHEAD_T < c1) {  /* a little faster, noisy */
            for (int l = 0; l < 1024; l += 64) {
                _mm_prefetch((const char *)(w0 + (c + AHEAD_T) * 16) + l, _MM_HINT_T0);
                if (w1) _mm_prefetch((const char *)(w1 + (c + AHEAD_T) * 16) + l, _MM_HINT_T0);
            }
        }
        tile_load(6, w0 + c * 16, 64);
        if (w1) tile_load(7, w1 + c * 16, 64);
        tile_load(4, xp + c, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (w1) _tile_dpbf16ps(1, 4, 7);
        if (two) {
            tile_load(5, xp + 16 * k + c, k * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (w1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    if (w1) _tile_stored(1, sums[1], 64);
    if (two) {
        _tile_stored(2, sums[2], 64);
        if (w1) _tile_stored(3, sums[3], 64);
    }
}

/* A pass's sums into y's rows [0, r), one block of 16 outputs or two. */
static void tiles_out(float (*sums)[16][16], void *y, int64_t n, int r, int blocks,
                      int y_f32) {
    const size_t yes = y_f32 ? 4 : 2;
    for (int i = 0; i < r; i++)
        for (int h = 0; h < blocks; h++) {
            __m512 v = _mm512_load_ps(sums[2 * (i / 16) + h][i % 16]);
            char *yo = (char *)y + (i * n + h * 16) * yes;
            if (y_f32)
                _mm512_storeu_ps((float *)yo, v);
            else
                _mm256_storeu_si256((__m256i *)yo, (__m256i)_mm512_cvtneps_pbh(v));
        }
}

static int packed_gemm_tiles_(const uint16_t *x, const uint16_t *w, void *y, int64_t m,
                              int64_t n, int64_t k, int y_f32) {
    if (m == 0) return 0;  /* (a tile of 0 rows is not a valid configuration) */
    uint16_t *padded = m > 16 && m % 16 ? padded_rows(x, m, k) : NULL;  /* whole row tiles */
    if (m > 16 && m % 16 && !padded) return 1;
    const uint16_t *xp = padded ? padded : x;
    const int64_t blocks = n / 16, pairs = (blocks + 1) / 2, passes = (m + 31) / 32;
    const int chunked = passes > 1 && k > TILES_WIDE;
    const int64_t chunk = chunked ? TILES_KC : k, nc = chunked ? TILES_NC : 1;
    const size_t yes = y_f32 ? 4 : 2;
    int failed = 0;
    #pragma omp parallel if (pairs >= 4 && m * n * k >= (1 << 18))
    {
        int64_t p0 = 0, p1 = pairs;  /* this thread's pairs */
#if defined(_OPENMP)
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        p0 = pairs * t / T, p1 = pairs * (t + 1) / T;
#endif
        /* each pass's sums between chunks (whole-k passes: one pass's at a time) */
        __attribute__((aligned(64))) float one[1][4][16][16];
        float (*buf)[4][16][16] = one;
        if (chunked) buf = aligned_alloc(64, (size_t)(passes * nc) * sizeof *buf);
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles(m);
            for (int64_t bb = p0; bb < p1; bb += nc) {
                const int64_t be = p1 - bb < nc ? p1 : bb + nc;
                for (int64_t c0 = 0; c0 < k; c0 += chunk) {
                    const int64_t c1 = k - c0 < chunk ? k : c0 + chunk;
                    for (int64_t i = 0; i < m; i += 32) {
                        const int r = m - i < 32 ? (int)(m - i) : 32;
                        for (int64_t b = bb; b < be; b++) {
                            const uint16_t *w0 = w + 2 * b * 16 * k;
                            const uint16_t *w1 = 2 * b + 1 < blocks ? w0 + 16 * k : NULL;
                            float (*sums)[16][16] = buf[chunked ? (i / 32) * nc + b - bb : 0];
                            tiles_pass(xp + i * k, k, c0, c1, w0, w1, sums, c0 > 0, r, i == 0);
                            if (c1 == k)
                                tiles_out(sums, (char *)y + (i * n + 2 * b * 16) * yes, n, r,
                                          w1 ? 2 : 1, y_f32);
                        }
                    }
                }
            }
            _tile_release();
            if (chunked) free(buf);
        }
    }
    free(padded);
    return failed;
}
#endif

static int tiles_on;  /* AMX tiles granted and asked for (packed_gemm_tiles) */

/* on 1: take AMX tiles from now on where this build and the OS allow (Linux's arch_prctl
 * ARCH_REQ_XCOMP_PERM, asked once); 0: the vdpbf16ps passes; -1: only ask. Set once at load,
 * before any call (a process's layers must keep one kernel). Returns whether tiles are on. */
int packed_gemm_tiles(int on) {
#if defined(PACKED_TILES)
    static int granted = -1;
    if (on == 1 && granted < 0) granted = amx_permission();
    if (on >= 0) tiles_on = on == 1 && granted == 1;
#else
    (void)on;
#endif
    return tiles_on;
}

/* x [m, k] bf16, w packed as above, y [m, n] bf16 (rounded to nearest even) or fp32 where
 * `y_f32`. n a multiple of 16 and k of 2, else (or without AVX-512 BF16) 1: nothing written. */
int packed_gemm(const void *x, const void *w, void *y, int64_t m, int64_t n, int64_t k,
                int y_f32) {
#if defined(__AVX512BF16__)
    if (n % 16 || k % 2 || m < 0) return 1;
#if defined(PACKED_TILES)
    if (tiles_on && k % 32 == 0) return packed_gemm_tiles_(x, w, y, m, n, k, y_f32);
#endif
    const int64_t pairs = k / 2, blocks = n / 16, groups = (blocks + 2) / 3;
    const size_t yes = y_f32 ? 4 : 2;
    #pragma omp parallel for schedule(static) if (m * n * k >= (1 << 18))
    for (int64_t g = 0; g < groups; g++) {
        const int64_t b0 = 3 * g;
        const int C = blocks - b0 < 3 ? (int)(blocks - b0) : 3;
        const uint16_t *wg = (const uint16_t *)w + b0 * 16 * k;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_P) {
            const int r = m - r0 < ROWS_P ? (int)(m - r0) : ROWS_P;
            const uint32_t *xr = (const uint32_t *)x + r0 * pairs;
            char *yr = (char *)y + (r0 * n + b0 * 16) * yes;
            const int first = r0 == 0;
#define PACKED(R, CC) packed_block(xr, pairs, wg, 16 * k, yr, n, R, CC, y_f32, first)
#define PACKED_ROWS(CC)                                                                    \
    switch (r) {                                                                           \
        case 8: PACKED(8, CC); break; case 7: PACKED(7, CC); break;                        \
        case 6: PACKED(6, CC); break; case 5: PACKED(5, CC); break;                        \
        case 4: PACKED(4, CC); break; case 3: PACKED(3, CC); break;                        \
        case 2: PACKED(2, CC); break; default: PACKED(1, CC);                              \
    }
            if (C == 3) PACKED_ROWS(3) else if (C == 2) PACKED_ROWS(2) else PACKED_ROWS(1)
#undef PACKED_ROWS
#undef PACKED
        }
    }
    return 0;
#else
    (void)x, (void)w, (void)y, (void)m, (void)n, (void)k, (void)y_f32;
    return 1;
#endif
}
