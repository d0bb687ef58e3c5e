/* The int4/int8 kernels' prefetch (avx512_gemm.c, avx2_gemm.c; amx_gemm.c through the first).
 * A kernel's first pass over a block of 32 outputs asks for the weights PREFETCH bytes ahead of
 * those it reads: the hardware's prefetchers alone left 2-6 rows compute-bound and memory-bound
 * in turn (Zen 5, weights streamed from memory: avx512_gemm.c at 4 rows 19-23 GB/s, 33-40 with
 * it; one row 40 against 43-48; avx2_gemm.c 1.1-1.6x). 1-16 KB ahead measured alike. Prefetches
 * never fault, so reading past a buffer's end is harmless, and they change no result. */
#ifndef LOCALSERVE_PREFETCH_H
#define LOCALSERVE_PREFETCH_H
#include <stdint.h>

#define PREFETCH 4096

static inline void ahead(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)p + PREFETCH + off);
}
#endif
