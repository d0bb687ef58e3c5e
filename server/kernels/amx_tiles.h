/* AMX tiles' setup, shared by amx_gemm.c (int4 and int8 weights), dense_gemm.c (bf16
 * weights) and paged_attention.c (bf16 prompt attention). Defines AMX_TILES where the build
 * has them; the including .c defines _GNU_SOURCE first (syscall() under -std=c11). */
#ifndef AMX_TILES_H
#define AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TILES 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes: 0-3 sums, 4-5 rows of x, 6-7 weights (16 pairs of bf16
 * inputs x 16 outputs). A call of m < 16 rows sets the x and sum tiles to m rows (fewer rows to
 * load, multiply and store: 1.2x at one row); a row's sums are the same either way. */
static inline void configure_tiles(int64_t m) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = (uint8_t)(t < 6 && m < 16 ? m : 16);
    }
    _tile_loadconfig(&c);
}

/* x [m, k] bf16 -> [ceil(m / 16) * 16, k], zero rows after m (whole x tiles to load); NULL
 * where out of memory, else free() it after. */
static inline uint16_t *padded_rows(const uint16_t *x, int64_t m, int64_t k) {
    const int64_t rows = (m + 15) / 16 * 16;
    uint16_t *p = aligned_alloc(64, (size_t)((rows * k * 2 + 63) / 64 * 64));
    if (!p) return NULL;
    memcpy(p, x, (size_t)(m * k * 2));
    memset(p + m * k, 0, (size_t)((rows - m) * k * 2));
    return p;
}

/* Linux's permission for this process to use AMX state (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA): 1 granted, 0 refused. */
static inline int amx_permission(void) {
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* gcc's _tile_loadd is an asm statement that names no memory: without this barrier the stores
 * of the data it loads are dropped or moved past it. */
#define tile_load(t, base, stride) \
    do { __asm__ volatile("" ::: "memory"); _tile_loadd(t, base, stride); } while (0)
#endif

#endif
