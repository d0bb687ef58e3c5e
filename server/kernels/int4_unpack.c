/* int4 -> bf16 dequantization of PyTorch's CPU int4 pack (the layout that
 * `_convert_weight_to_int4pack_for_cpu(q, 2)` writes and `_weight_int4pack_mm_for_cpu` reads).
 *
 * The packed tensor is [N, K/2] uint8, read as [N/B][K][B/2] bytes: byte j of (block b, column
 * k) holds q[Bb + j, k] in its low nibble and q[Bb + B/2 + j, k] in its high nibble, with B
 * = 64 where PyTorch runs its AVX-512 kernels and 32 with its AVX2 ones (`block`). Scales and
 * zeros are bf16 [K/G][N][2]; w = (q - 8) * scale + zero, computed in fp32 and rounded to bf16
 * (nearest even), as the reference dequantization does.
 *
 * The output is the transposed weight, bf16 [K][N], so that x @ out is the layer: every write
 * is a run of 32 contiguous values. Rows [k0, k1) only, so callers can split the work.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

int int4pack_to_bf16_t(const uint8_t *packed, const uint16_t *scales_zeros, uint16_t *out,
                       int64_t n, int64_t k, int64_t group, int64_t k0, int64_t k1,
                       int64_t block) {
    if ((block != 64 && block != 32) || n % block || k % group || k0 < 0 || k1 > k || k0 > k1)
        return 1;
    const int64_t half = block / 2;
    /* With -fopenmp this joins the OpenMP runtime PyTorch already loaded (same soname): the
     * rows are split over torch's threads, no second thread pool. */
    #pragma omp parallel for schedule(static)
    for (int64_t c = k0; c < k1; c++) {
        const uint16_t *sz = scales_zeros + (c / group) * n * 2;
        uint16_t *row = out + c * n;
        for (int64_t b = 0; b < n / block; b++) {
            const uint8_t *src = packed + (b * k + c) * half;
            float lo[32], hi[32];
            for (int64_t j = 0; j < half; j++) {
                lo[j] = (float)(src[j] & 0x0F) - 8.0f;
                hi[j] = (float)(src[j] >> 4) - 8.0f;
            }
            for (int64_t j = 0; j < half; j++) {
                int64_t i = b * block + j;
                row[i] = float_to_bf16(lo[j] * bf16_to_float(sz[2 * i]) + bf16_to_float(sz[2 * i + 1]));
            }
            for (int64_t j = 0; j < half; j++) {
                int64_t i = b * block + half + j;
                row[i] = float_to_bf16(hi[j] * bf16_to_float(sz[2 * i]) + bf16_to_float(sz[2 * i + 1]));
            }
        }
    }
    return 0;
}
