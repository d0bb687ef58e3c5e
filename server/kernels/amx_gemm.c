/* int4 and int8 weights times bf16 activations with AMX tiles (Intel Sapphire Rapids on):
 * the same functions, layouts and arithmetic per group as avx512_gemm.c (its helpers from
 * avx512_gemm.h; the library is built from both sources), with the products summed by
 * TDPBF16PS instead of VDPBF16PS.
 *
 * avx512_gemm.c spends 2 VDPBF16PS per row for every pair of inputs and 32 outputs, so from a
 * few rows on it is compute-bound (1536 x 576 at 32 rows: ~3x oneDNN's AMX GEMM). Here a block
 * of 32 outputs unpacks its nibbles to bf16 once per chunk of 32 inputs, exactly as there (q - 8
 * through one vpermw lookup), into two B tiles (16 input pairs x 16 outputs, which is the
 * layout's own order), and one TDPBF16PS takes 16 rows x 16 outputs x 32 inputs.
 *
 * int4: per group the tiles hold sum_k x * (q - 8) (products exact in fp32); they are stored
 * and every row adds scale * that + zero * sum_k x in fp32 in avx512_gemm.c's order, so the
 * weights are never rounded. int8: the tiles sum over every input, times the row scale at the
 * end. Groups and input widths must be multiples of 32 (one tile's depth); other layers take
 * avx512_gemm.c's kernels, whatever the row count. An engine step's prompt rows of int4 layers
 * take amx_int4_gemm_prompt instead (the weights dequantized to bf16, no step per group).
 *
 * Calls of one row (a decode step at one sequence: the LM head, q/k/v) take AVX-512 FMAs
 * instead, in the order TDPBF16PS sums, so with the tiles' bits (block8_row, block4_row; each
 * checked against the tiles once on this CPU, else the tiles): the tiles spent most of such a
 * call widening the weights to bf16 for B tiles (the int8 head 1.5x the FMAs' time, int4
 * layers 1.2x). Both run with MXCSR's flush-to-zero and denormals-are-zero set, as the tiles
 * compute, and so do the int4 tiles' per-group fp32 steps.
 *
 * Batch invariance: a tile row's sums depend on that row of x and the weights only, and every
 * row of a call takes the same instructions whatever the row count (rows are padded with zeros
 * to whole tiles, tile rows past the call's are never read back; a call of fewer than 16 rows
 * sets its tiles to that many rows, which changes no row's sums).
 *
 * The kernel needs the process's permission for AMX state (Linux's arch_prctl
 * ARCH_REQ_XCOMP_PERM); amx_gemm_available() asks once and returns 0 where it is refused or the
 * compiler lacks AMX: the caller then takes avx512_gemm.c's library.
 */
#define _GNU_SOURCE /* syscall() in unistd.h under -std=c11 (gcc 14 rejects implicit declarations) */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "avx512_gemm.h"

#if defined(__AVX512BF16__) && defined(AMX_TILES) && defined(__AMX_BF16__)

/* Tiles (amx_tiles.h): 0-3 sums (row tile t, output half h at 2t + h), 4-5 rows of x, 6-7
 * weights. */

#define CHUNK 32  /* inputs per tile product */
#define TILE_ROWS 16

/* One chunk of 32 inputs for rows [0, 16 * tiles) of xp (row stride k), weights already in
 * tiles 6 and 7: sums into tiles 0-3. */
static inline void chunk_products(const uint16_t *xp, int64_t k, int tiles) {
    tile_load(4, xp, k * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (tiles == 2) {
        tile_load(5, xp + TILE_ROWS * k, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

static inline void store_sums(float (*sums)[TILE_ROWS][16], int tiles) {
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (tiles == 2) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
}

static inline void zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The nibbles of one chunk of 32 inputs x 32 outputs as q - 8 in bf16: two B tiles (outputs
 * 0-15, then 16-31), each 16 input pairs x 16 outputs x 2. */
static inline void unpack_chunk(const uint8_t *pk, __m512i table, uint16_t (*w)[TILE_ROWS][32]) {
    const __m512i low = _mm512_set1_epi16(0x0F);
    for (int p = 0; p < TILE_ROWS; p++) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(pk + p * 32)));
        _mm512_store_si512(w[0][p], _mm512_permutexvar_epi16(_mm512_and_si512(v, low), table));
        _mm512_store_si512(w[1][p], _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    }
}

/* acc[i] += scale * sums + zero * x's group sum, for rows [0, r) of one group. */
static inline void scale_group(__m512 (*acc)[2], float (*sums)[TILE_ROWS][16],
                               const uint8_t *head, const float *xsum, int64_t groups, int r) {
    const __m512 s0 = half16(head), s1 = half16(head + 32);
    const __m512 z0 = half16(head + 64), z1 = half16(head + 96);
    for (int i = 0; i < r; i++) {
        const int t = i / TILE_ROWS, row = i % TILE_ROWS;
        __m512 xs = _mm512_set1_ps(xsum[i * groups]);
        __m512 a0 = _mm512_load_ps(sums[2 * t][row]), a1 = _mm512_load_ps(sums[2 * t + 1][row]);
        acc[i][0] = _mm512_add_ps(_mm512_add_ps(acc[i][0], _mm512_mul_ps(a0, s0)),
                                  _mm512_mul_ps(xs, z0));
        acc[i][1] = _mm512_add_ps(_mm512_add_ps(acc[i][1], _mm512_mul_ps(a1, s1)),
                                  _mm512_mul_ps(xs, z1));
    }
}

/* Rows [0, r) (r <= 32) of xp against one block of 32 outputs of the int4 layout; `unpacked`:
 * the block's chunks already unpacked in order (calls of more than 32 rows unpack once), or
 * NULL. A group's sums are scaled one group later, so that the tiles' stores are done by
 * then (the order of every row's arithmetic is the same). */
static void block_amx(const uint16_t *xp, int64_t k, const float *xsum, int64_t groups,
                      int64_t group, const uint8_t *blk, const uint16_t *unpacked, uint16_t *y,
                      int64_t n, int r, __m512i table, int first) {
    __attribute__((aligned(64))) uint16_t w[2][2][TILE_ROWS][32];
    __attribute__((aligned(64))) float sums[2][4][TILE_ROWS][16];
    __m512 acc[32][2];
    const int tiles = r > TILE_ROWS ? 2 : 1;
    for (int i = 0; i < r; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    zero_sums();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *pk = blk + g * group_bytes(group) + GROUP_HEAD;
        if (first && !unpacked) ahead(blk + g * group_bytes(group), group_bytes(group));
        for (int64_t c = 0; c < group; c += CHUNK) {
            if (unpacked) {
                const uint16_t *u = unpacked + (g * group + c) / CHUNK * 2 * TILE_ROWS * 32;
                tile_load(6, u, 64);
                tile_load(7, u + TILE_ROWS * 32, 64);
            } else {
                uint16_t (*wc)[TILE_ROWS][32] = w[(g * group + c) / CHUNK % 2];
                unpack_chunk(pk + c / 2 * 32, table, wc);
                tile_load(6, wc[0], 64);
                tile_load(7, wc[1], 64);
            }
            chunk_products(xp + g * group + c, k, tiles);
        }
        store_sums(sums[g % 2], tiles);
        zero_sums();
        if (g > 0)
            scale_group(acc, sums[(g - 1) % 2], blk + (g - 1) * group_bytes(group),
                        xsum + g - 1, groups, r);
    }
    scale_group(acc, sums[(groups - 1) % 2], blk + (groups - 1) * group_bytes(group),
                xsum + groups - 1, groups, r);
    for (int i = 0; i < r; i++) {
        store_bf16(y + i * n, acc[i][0]);
        store_bf16(y + i * n + 16, acc[i][1]);
    }
}

static int amx_state = -1;  /* -1 not asked yet, 0 refused, 1 granted */

int amx_gemm_available(void) {
    if (amx_state < 0)
        amx_state = amx_permission();
    return amx_state;
}

#define MXCSR_FTZ_DAZ 0x8040  /* flush-to-zero, denormals-are-zero: as the tiles compute */

/* This thread's MXCSR set to flush denormals as the tiles do; returns the old one, to restore
 * with _mm_setcsr. */
static inline unsigned int flush_denormals(void) {
    const unsigned int old = _mm_getcsr();
    _mm_setcsr(old | MXCSR_FTZ_DAZ);
    return old;
}

/* The FMA paths' shared steps, in TDPBF16PS's order: a row's input pair (x even, x odd)
 * repeated over 16 lanes (each lane's fused-add chain takes one of them); and per tile product
 * sums += even chain + odd chain, for 32 outputs whose chains are chain[0..3], 8 outputs each,
 * their lanes (even, odd) side by side. */
static inline __m512 input_pair(const float *x) {
    double pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_castpd_ps(_mm512_set1_pd(pair));
}

static inline void fold_chains(const __m512 chain[4], __m512 sums[2]) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int h = 0; h < 2; h++) {
        const __m512 e = _mm512_permutex2var_ps(chain[2 * h], even, chain[2 * h + 1]);
        const __m512 o = _mm512_permutex2var_ps(chain[2 * h], odd, chain[2 * h + 1]);
        sums[h] = _mm512_add_ps(sums[h], _mm512_add_ps(e, o));
    }
}

/* Row `row` of a check's rows (k values, zero-padded to 16 rows in x, and as fp32 in xf):
 * row 0 tiny values and denormals, the others spanning them to 2^40, a sixteenth zeros. */
static void check_row(uint16_t *x, float *xf, int64_t k, int row, uint32_t *state) {
    memset(x, 0, (size_t)(16 * k * 2));
    for (int64_t j = 0; j < k; j++) {
        *state = *state * 1664525u + 1013904223u;
        const uint32_t exponent = row == 0 ? (*state >> 8) % 4 : (*state >> 8) % 168;
        x[j] = (uint16_t)((*state >> 31) << 15 | exponent << 7 | ((*state >> 16) & 0x7F));
        if ((*state >> 20) % 17 == 0) x[j] = 0;
    }
    load_row(xf, x, k, 1);
}

/* A row of k bf16 values as fp32 (exact), for the FMA paths; NULL where out of memory, else
 * free() it after. */
static float *row_fp32(const uint16_t *x, int64_t k) {
    float *xf = aligned_alloc(64, (size_t)((k * 4 + 63) / 64 * 64));
    if (xf) load_row(xf, x, k, 1);
    return xf;
}

/* One row's sums of x * (q - 8) over one group of 32 outputs of the int4 layout, with AVX-512
 * FMAs in the order TDPBF16PS sums (input_pair, fold_chains): bit for bit what block_amx's tiles
 * hold for the row, under the same MXCSR (flush-to-zero and denormals-are-zero: the callers
 * set them for both). A pair's 32 bytes: bytes 2i + h hold input 2p + h of output i (low
 * nibble) and 16 + i (high), so 16 bytes widened are 8 outputs' (even, odd) lanes, and vpermps
 * takes an index's low 4 bits: q - 8 from a table. */
static inline void row_group(const float *xg, const uint8_t *nibbles, int64_t group,
                             __m512 sums[2]) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    sums[0] = sums[1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < group; c += CHUNK) {
        const uint8_t *pk = nibbles + c / 2 * 32;
        /* chain[q]: outputs 8q..8q+7 (q 0, 1 the low nibbles, 2, 3 the high ones) */
        __m512 chain[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                           _mm512_setzero_ps()};
        for (int p = 0; p < TILE_ROWS; p++) {
            const __m512 xp = input_pair(xg + c + 2 * p);
            for (int half = 0; half < 2; half++) {
                const __m512i v = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(pk + p * 32 + half * 16)));
                chain[half] = _mm512_fmadd_ps(xp, _mm512_permutexvar_ps(v, table), chain[half]);
                chain[2 + half] = _mm512_fmadd_ps(
                    xp, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), chain[2 + half]);
            }
        }
        fold_chains(chain, sums);
    }
}

/* One row against one block of 32 outputs of the int4 layout, as block_amx: each group's sums
 * by row_group, then scaled as scale_group scales them. */
static void block4_row(const float *xf, const float *xsum, int64_t groups, int64_t group,
                       const uint8_t *blk, uint16_t *y) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = blk + g * group_bytes(group);
        ahead(head, group_bytes(group));
        __m512 sums[2];
        row_group(xf + g * group, head + GROUP_HEAD, group, sums);
        const __m512 xs = _mm512_set1_ps(xsum[g]);
        acc[0] = _mm512_add_ps(_mm512_add_ps(acc[0], _mm512_mul_ps(sums[0], half16(head))),
                               _mm512_mul_ps(xs, half16(head + 64)));
        acc[1] = _mm512_add_ps(_mm512_add_ps(acc[1], _mm512_mul_ps(sums[1], half16(head + 32))),
                               _mm512_mul_ps(xs, half16(head + 96)));
    }
    store_bf16(y, acc[0]);
    store_bf16(y + 16, acc[1]);
}

/* Whether block4_row gives block_amx's bits on this CPU: one block of 32 outputs x 512 inputs
 * in groups of 32 and of 64 (scales and zeros of many sizes), 8 rows whose values span zero,
 * denormals and 2^40: each group's fp32 sums from the tiles and from row_group, and the rows'
 * outputs through both. */
static int int4_row_agrees(void) {
    enum { K = 512, CHECKED_ROWS = 8 };
    static uint8_t blk[K / 32 * (GROUP_HEAD + 32 * 16)] __attribute__((aligned(64)));
    static uint16_t x[16 * K] __attribute__((aligned(64)));
    static float xf[K], xsum[K / 32];
    uint16_t tiles[32], fmas[32];
    uint32_t state = 54321;
    const __m512i nibbles = nibble_table();
    int agrees = 1;
    for (int64_t group = 32; group <= 64 && agrees; group *= 2) {
        const int64_t groups = K / group;
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *head = blk + g * group_bytes(group);
            for (int j = 0; j < 64; j++) {  /* fp16 scales (positive) and zeros, 2^-10..2^5 */
                state = state * 1664525u + 1013904223u;
                const uint16_t h = (uint16_t)(((state >> 8) % 16 + 5) << 10 | (state >> 16) % 1024);
                const uint16_t bits = j < 32 ? h : (uint16_t)(h | (state >> 31) << 15);
                memcpy(head + 2 * j, &bits, 2);
            }
            for (int64_t j = 0; j < group * 16; j++) {
                state = state * 1664525u + 1013904223u;
                head[GROUP_HEAD + j] = (uint8_t)(state >> 24);
            }
        }
        for (int row = 0; row < CHECKED_ROWS && agrees; row++) {
            check_row(x, xf, K, row, &state);
            group_sums(x, xsum, 1, K, group);
            const unsigned int mxcsr = flush_denormals();
            configure_tiles(1);
            for (int64_t g = 0; g < groups && agrees; g++) {  /* each group's fp32 sums */
                __attribute__((aligned(64))) uint16_t w[2][TILE_ROWS][32];
                __attribute__((aligned(64))) float held[2][TILE_ROWS][16];
                const uint8_t *pk = blk + g * group_bytes(group) + GROUP_HEAD;
                zero_sums();
                for (int64_t c = 0; c < group; c += CHUNK) {
                    unpack_chunk(pk + c / 2 * 32, nibbles, w);
                    tile_load(6, w[0], 64);
                    tile_load(7, w[1], 64);
                    chunk_products(x + g * group + c, K, 1);
                }
                store_sums(held, 1);
                __m512 sums[2];
                row_group(xf + g * group, pk, group, sums);
                agrees = memcmp(held[0][0], &sums[0], 64) == 0 &&
                         memcmp(held[1][0], &sums[1], 64) == 0;
            }
            block_amx(x, K, xsum, groups, group, blk, NULL, tiles, 32, 1, nibbles, 0);
            _tile_release();
            block4_row(xf, xsum, groups, group, blk, fmas);
            _mm_setcsr(mxcsr);
            agrees = agrees && memcmp(tiles, fmas, sizeof tiles) == 0;
        }
    }
    return agrees;
}

static int int4_row_ok = -1;  /* -1 not asked yet */

/* 1 where one-row calls of amx_int4_gemm's tile outputs take block4_row (bit for bit the
 * tiles, checked here once), 0 where they keep the tiles. */
int amx_int4_row_path(void) {
    if (int4_row_ok < 0) int4_row_ok = amx_gemm_available() == 1 && int4_row_agrees();
    return int4_row_ok;
}

/* One row through block4_row, every block of the call's tile outputs. */
static int int4_row(const uint16_t *x, const float *xsum, const uint8_t *packed, uint16_t *y,
                    int64_t blocks, int64_t k, int64_t group) {
    float *xf = row_fp32(x, k);
    if (!xf) return 1;
    const int64_t groups = k / group;
    #pragma omp parallel if (blocks >= 4)
    {
        const unsigned int mxcsr = flush_denormals();
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            block4_row(xf, xsum, groups, group, packed + b * groups * group_bytes(group),
                       y + b * 32);
        _mm_setcsr(mxcsr);
    }
    free(xf);
    return 0;
}

/* As avx512_gemm.c's int4_gemm (same arguments and results but for the order of the sums). */
int amx_int4_gemm(const uint16_t *x, const uint8_t *packed, uint16_t *y, float *xsum, int64_t m,
                  int64_t n, int64_t k, int64_t group, int64_t int8_from) {
    if (int8_from < 0 || int8_from > n || int8_from % 32) return 1;
    if (amx_state != 1 || group % CHUNK)
        return amx_state == 1 ? avx512_int4_gemm(x, packed, y, xsum, m, n, k, group, int8_from)
                              : 1;
    if (n % 32 || k % group) return 1;
    if (m == 0) return 0;  /* (a tile of 0 rows is not a valid configuration) */
    int64_t groups = k / group, blocks = n / 32;
    if (group == 32 && int8_from < n && avx512_gemm_a8()) {  /* int8 inputs: avx512_gemm.c's */
        if (avx512_int4_gemm_a8(x, packed, y, m, n, k, int8_from / 32)) return 1;
        blocks = int8_from / 32;
        if (!blocks) return 0;
    }
    group_sums(x, xsum, m, k, group);
    if (m == 1 && amx_int4_row_path()) return int4_row(x, xsum, packed, y, blocks, k, group);
    uint16_t *xp = padded_rows(x, m, k);
    if (!xp) return 1;
    const __m512i table = nibble_table();
    int failed = 0;
    #pragma omp parallel if (blocks >= 4) reduction(|:failed)
    {
        /* The tiles flush denormals; the groups' fp32 steps here do too (block4_row's). */
        const unsigned int mxcsr = flush_denormals();
        /* More than 32 rows: each block's chunks are unpacked once, for every 32 rows. */
        uint16_t *unpacked = NULL;
        if (m > 2 * TILE_ROWS) {
            unpacked = aligned_alloc(64, (size_t)(k / CHUNK * 2 * TILE_ROWS * 64));
            failed = unpacked == NULL;
        }
        configure_tiles(m);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = packed + b * groups * group_bytes(group);
            if (failed) continue;
            if (unpacked)
                for (int64_t c = 0; c < k; c += CHUNK) {
                    const uint8_t *pk = blk + c / group * group_bytes(group) + GROUP_HEAD;
                    uint16_t *u = unpacked + c / CHUNK * 2 * TILE_ROWS * 32;
                    unpack_chunk(pk + c % group / 2 * 32, table, (uint16_t (*)[TILE_ROWS][32])u);
                }
            for (int64_t i = 0; i < m; i += 2 * TILE_ROWS) {
                int r = m - i < 2 * TILE_ROWS ? (int)(m - i) : 2 * TILE_ROWS;
                block_amx(xp + i * k, k, xsum + i * groups, groups, group, blk, unpacked,
                          y + i * n + b * 32, n, r, table, i == 0);
            }
        }
        _tile_release();
        _mm_setcsr(mxcsr);
        free(unpacked);
    }
    free(xp);
    return failed;
}

/* Rows [0, r) (r <= 32) of xp against one block of 32 outputs of the int8 layout. */
static void block8_amx(const uint16_t *xp, int64_t k, const int8_t *blk, const float *scale,
                       void *y, int64_t n, int r, int out_fp32, int first) {
    __attribute__((aligned(64))) uint16_t w[2][TILE_ROWS][32];
    __attribute__((aligned(64))) float sums[4][TILE_ROWS][16];
    const int tiles = r > TILE_ROWS ? 2 : 1;
    zero_sums();
    for (int64_t c = 0; c < k; c += CHUNK) {
        if (first) ahead(blk + c / 2 * 64, TILE_ROWS * 64);
        for (int p = 0; p < TILE_ROWS; p++) {
            const int8_t *pair = blk + (c / 2 + p) * 64;
            _mm512_store_si512(w[0][p], int8_pairs(pair));
            _mm512_store_si512(w[1][p], int8_pairs(pair + 32));
        }
        tile_load(6, w[0], 64);
        tile_load(7, w[1], 64);
        chunk_products(xp + c, k, tiles);
    }
    store_sums(sums, tiles);
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    for (int i = 0; i < r; i++) {
        const int t = i / TILE_ROWS, row = i % TILE_ROWS;
        store_outputs((char *)y + i * n * (out_fp32 ? 4 : 2),
                      _mm512_mul_ps(_mm512_load_ps(sums[2 * t][row]), s0),
                      _mm512_mul_ps(_mm512_load_ps(sums[2 * t + 1][row]), s1), out_fp32);
    }
}

/* One row against one block of 32 outputs of the int8 layout, with AVX-512 FMAs in the order
 * TDPBF16PS sums (KERNELS.md: per tile product, output and input pair, the even inputs'
 * products in one chain of fused adds from zero and the odd inputs' in another, then
 * tile += even + odd), so bit for bit block8_amx's sums for that row; the caller sets MXCSR's
 * flush-to-zero and denormals-are-zero, as the tiles have them. A pair's 64 bytes hold
 * outputs 0-31's even and odd weights side by side: 16 of them widened to fp32 are 8 outputs'
 * (even, odd), against the row's pair (x even, x odd) repeated, so each lane is one chain. */
static void block8_row(const float *xf, int64_t k, const int8_t *blk, const float *scale,
                       void *y, int out_fp32) {
    __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < k; c += CHUNK) {
        const int8_t *pk = blk + c / 2 * 64;
        ahead(pk, TILE_ROWS * 64);
        __m512 chain[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                           _mm512_setzero_ps()};
        for (int p = 0; p < TILE_ROWS; p++) {
            const __m512 xp = input_pair(xf + c + 2 * p);
            for (int q = 0; q < 4; q++) {
                const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(pk + p * 64 + q * 16))));
                chain[q] = _mm512_fmadd_ps(xp, w, chain[q]);
            }
        }
        fold_chains(chain, sums);
    }
    store_outputs(y, _mm512_mul_ps(sums[0], _mm512_loadu_ps(scale)),
                  _mm512_mul_ps(sums[1], _mm512_loadu_ps(scale + 16)), out_fp32);
}

/* One row through block8_row, every block. */
static int int8_row(const uint16_t *x, const int8_t *packed, const float *scale, void *y,
                    int64_t n, int64_t k, int out_fp32) {
    float *xf = row_fp32(x, k);
    if (!xf) return 1;
    const int64_t blocks = n / 32;
    #pragma omp parallel if (blocks >= 4)
    {
        const unsigned int mxcsr = flush_denormals();
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            block8_row(xf, k, packed + b * k * 32, scale + b * 32,
                       (char *)y + b * 32 * (out_fp32 ? 4 : 2), out_fp32);
        _mm_setcsr(mxcsr);
    }
    free(xf);
    return 0;
}

/* Whether block8_row gives block8_amx's bits on this CPU (the order it copies was measured on
 * one AMX model): one block of 32 outputs x 512 inputs, 8 rows whose values span zero,
 * denormals and 2^40, each through both; asked once (int8_row_path). */
static int int8_row_agrees(void) {
    enum { K = 512, CHECKED_ROWS = 8 };
    static int8_t blk[32 * K] __attribute__((aligned(64)));
    static uint16_t x[16 * K] __attribute__((aligned(64)));
    static float xf[K], scale[32], tiles[32], fmas[32];
    uint32_t state = 12345;
    for (int j = 0; j < 32 * K; j++) {
        state = state * 1664525u + 1013904223u;
        blk[j] = (int8_t)((state >> 24) % 255 - 127);
    }
    for (int j = 0; j < 32; j++) scale[j] = 1.0f;
    int agrees = 1;
    for (int row = 0; row < CHECKED_ROWS && agrees; row++) {
        check_row(x, xf, K, row, &state);
        configure_tiles(1);
        block8_amx(x, K, blk, scale, tiles, 32, 1, 1, 0);
        _tile_release();
        const unsigned int mxcsr = flush_denormals();
        block8_row(xf, K, blk, scale, fmas, 1);
        _mm_setcsr(mxcsr);
        agrees = memcmp(tiles, fmas, sizeof tiles) == 0;
    }
    return agrees;
}

static int int8_row_ok = -1;  /* -1 not asked yet */

/* 1 where one-row calls of amx_int8_gemm take block8_row (bit for bit the tiles, checked here
 * once), 0 where they keep the tiles. */
int amx_int8_row_path(void) {
    if (int8_row_ok < 0) int8_row_ok = amx_gemm_available() == 1 && int8_row_agrees();
    return int8_row_ok;
}

/* As avx512_gemm.c's int8_gemm. */
int amx_int8_gemm(const uint16_t *x, const int8_t *packed, const float *scale, void *y, int64_t m,
                  int64_t n, int64_t k, int out_fp32) {
    if (amx_state != 1 || k % CHUNK)
        return amx_state == 1 ? avx512_int8_gemm(x, packed, scale, y, m, n, k, out_fp32) : 1;
    if (n % 32) return 1;
    if (m == 0) return 0;
    if (m == 1 && amx_int8_row_path()) return int8_row(x, packed, scale, y, n, k, out_fp32);
    int64_t blocks = n / 32;
    uint16_t *xp = padded_rows(x, m, k);
    if (!xp) return 1;
    #pragma omp parallel if (blocks >= 4)
    {
        configure_tiles(m);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *blk = packed + b * k * 32;
            for (int64_t i = 0; i < m; i += 2 * TILE_ROWS) {
                int r = m - i < 2 * TILE_ROWS ? (int)(m - i) : 2 * TILE_ROWS;
                char *yi = (char *)y + (i * n + b * 32) * (out_fp32 ? 4 : 2);
                block8_amx(xp + i * k, k, blk, scale + b * 32, yi, n, r, out_fp32, i == 0);
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}

/* Prompt rows of int4 layers (rows.py; generated rows keep amx_int4_gemm): the weights
 * dequantized to bf16, w = (q - 8) * scale + zero in fp32 rounded to nearest even (the values
 * avx512_int4_unpack_q4x32 writes, bit for bit), then y = x @ w^T summed by TDPBF16PS over every
 * input in order, as dense_gemm.c's tiles sum a bf16 layer: no fp32 step per group, so from ~32
 * rows on 1.3-3.4x amx_int4_gemm's int8-input passes (KERNELS.md). Each thread dequantizes a
 * block of 32 outputs whole into its own buffer (k x 64 bytes, in L2) once a call, then every
 * pass of 32 rows reads it from there. A row's sums depend on that row and the weights only
 * (rows padded to whole tiles, tile rows past the call's never read back), so prompt rows are
 * the same in any chunk and beside any rows; the dequantizing FMAs meet no denormal ((q - 8) *
 * scale is exact and scale and zero are fp16: a nonzero sum is at least 2^-24). */

/* Lanes 2i and 2i + 1 of half16(p)'s values i (the 8 outputs of one half of a tile row). */
static inline void pair_lanes(const uint8_t *p, __m512 out[2]) {
    const __m512 v = half16(p);
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    out[0] = _mm512_permutexvar_ps(lo, v);
    out[1] = _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(8)), v);
}

/* One chunk of 32 inputs x 32 outputs as two B tiles of w (outputs 0-15, then 16-31): scale
 * and zero s[h], z[h] for outputs 8h..8h+7 (h 0, 1 the low nibbles, 2, 3 the high ones), each
 * output's twice (pair_lanes). */
static inline void dequantize_chunk(const uint8_t *pk, const __m512 s[4], const __m512 z[4],
                                    uint16_t (*w)[TILE_ROWS][32]) {
    const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int p = 0; p < TILE_ROWS; p++) {
        __m512 f[4];
        for (int half = 0; half < 2; half++) {
            const __m512i b = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(pk + p * 32 + half * 16)));
            const __m512i q[2] = {_mm512_and_si512(b, low), _mm512_srli_epi32(b, 4)};
            for (int h = 0; h < 2; h++)
                f[2 * h + half] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(q[h], eight)), s[2 * h + half],
                    z[2 * h + half]);
        }
        _mm512_store_si512(w[0][p], (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
        _mm512_store_si512(w[1][p], (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
    }
}

/* A block of 32 outputs, every chunk in order, into `w` ([k / 32][2][16][32]: each chunk's two
 * B tiles). */
static void dequantize_block(const uint8_t *blk, int64_t k, int64_t group, uint16_t *w) {
    for (int64_t g = 0; g < k / group; g++) {
        const uint8_t *head = blk + g * group_bytes(group);
        __m512 s[4], z[4];
        pair_lanes(head, s);
        pair_lanes(head + 32, s + 2);
        pair_lanes(head + 64, z);
        pair_lanes(head + 96, z + 2);
        for (int64_t c = 0; c < group; c += CHUNK)
            dequantize_chunk(head + GROUP_HEAD + c / 2 * 32, s, z,
                             (uint16_t (*)[TILE_ROWS][32])(w + (g * group + c) * 32));
    }
}

/* y [m, n] (bf16, or fp32 where out_fp32) = x [m, k] bf16 @ the int4 layout's weights
 * dequantized to bf16. 1: a shape it does not take (groups not multiples of 32) or no AMX. */
int amx_int4_gemm_prompt(const uint16_t *x, const uint8_t *packed, void *y, int64_t m,
                         int64_t n, int64_t k, int64_t group, int out_fp32) {
    if (amx_state != 1 || group % CHUNK || n % 32 || k % group || m < 0) return 1;
    if (m == 0) return 0;
    uint16_t *padded = m > TILE_ROWS && m % TILE_ROWS ? padded_rows(x, m, k) : NULL;
    if (m > TILE_ROWS && m % TILE_ROWS && !padded) return 1;
    const uint16_t *xp = padded ? padded : x;
    const int64_t groups = k / group, blocks = n / 32;
    const size_t yes = out_fp32 ? 4 : 2;
    int failed = 0;
    #pragma omp parallel if (blocks >= 4) reduction(|:failed)
    {
        /* every thread meets the loop (its barrier), with its buffer or without */
        uint16_t *w = aligned_alloc(64, (size_t)(k * 32 * 2));
        __attribute__((aligned(64))) float sums[4][TILE_ROWS][16];
        failed = w == NULL;
        configure_tiles(m);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!w) continue;
            dequantize_block(packed + b * groups * group_bytes(group), k, group, w);
            for (int64_t i = 0; i < m; i += 2 * TILE_ROWS) {
                const int r = m - i < 2 * TILE_ROWS ? (int)(m - i) : 2 * TILE_ROWS;
                const int tiles = r > TILE_ROWS ? 2 : 1;
                zero_sums();
                for (int64_t c = 0; c < k; c += CHUNK) {
                    tile_load(6, w + c * 32, 64);
                    tile_load(7, w + c * 32 + TILE_ROWS * 32, 64);
                    chunk_products(xp + i * k + c, k, tiles);
                }
                store_sums(sums, tiles);
                for (int j = 0; j < r; j++) {
                    const int t = j / TILE_ROWS, row = j % TILE_ROWS;
                    store_outputs((char *)y + ((i + j) * n + b * 32) * yes,
                                  _mm512_load_ps(sums[2 * t][row]),
                                  _mm512_load_ps(sums[2 * t + 1][row]), out_fp32);
                }
            }
        }
        _tile_release();
        free(w);
    }
    free(padded);
    return failed;
}

/* 1 where int4_gemm's int8_from takes int8 inputs (avx512_gemm.c's vpdpbusd path). */
int amx_gemm_a8(void) { return avx512_gemm_a8(); }

#else

int amx_gemm_available(void) { return 0; }

int amx_int4_gemm(const void *x, const void *packed, void *y, void *xsum, int64_t m, int64_t n,
                  int64_t k, int64_t group, int64_t int8_from) {
    return 1;
}

int amx_gemm_a8(void) { return 0; }

int amx_int8_row_path(void) { return 0; }

int amx_int4_row_path(void) { return 0; }

int amx_int4_gemm_prompt(const void *x, const void *packed, void *y, int64_t m, int64_t n,
                         int64_t k, int64_t group, int out_fp32) {
    return 1;
}

int amx_int8_gemm(const void *x, const void *packed, const void *scale, void *y, int64_t m,
                  int64_t n, int64_t k, int out_fp32) {
    return 1;
}

#endif

/* Prompt rows' unpacking is avx512_gemm.c's: the tiles add nothing to it. */
int amx_int4_unpack_q4x32(const void *packed, void *out, int64_t n, int64_t k, int64_t group,
                          int64_t k0, int64_t k1) {
    return avx512_int4_unpack_q4x32(packed, out, n, k, group, k0, k1);
}
