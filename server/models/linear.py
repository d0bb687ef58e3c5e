"""Matmuls whose every row is computed the same way whatever the other rows of the call.

A GEMM library picks its kernel and blocking by shape: MKL's fp32 GEMM takes another path below
4 rows, oneDNN's bf16 GEMM changes its blocking at 512 rows of a 1536-wide input (both measured,
AVX-512 BF16), and on AMX machines oneDNN chooses between AMX and AVX-512 kernels by shape. So a
row's value would depend on how many rows share its call: on the batch, the chunking of a
prompt, the prefix cache. `tiled_mm` calls the GEMM with exactly `tile` rows every time (the
last call zero-padded), so every call has one shape and each row's arithmetic depends on its
own values only."""

from __future__ import annotations

import torch
from torch import nn

# Rows per GEMM call: prompt rows (of dense layers, and of quantized layers through their
# unpacked weights) and generated rows of dense layers, the LM head's sampling rows included.
# Measured (bf16, AVX-512 BF16): a call of 8 rows costs 1.1-1.4x one of 1 row, 16 rows 1.5-1.8x;
# smollm2-135m:bf16 decodes 26/270/277 tok/s at 1/16/32 sequences with tiles of 8, 23/320/321
# with 16. Prompts in tiles of 32 cost 9% more than 64 at 1,000 tokens and 25% less for a short
# prompt after a prefix hit.
PROMPT_TILE = 32
GENERATED_TILE = 16


# A weight bigger than this (an LM head: 49,152 x 576 bf16 is 57 MB) is multiplied a block of
# columns at a time, every row tile within a block, so it streams from memory once per step
# instead of once per row tile.
COLUMN_BLOCK_BYTES = 4 << 20


def tiled_mm(x: torch.Tensor, weight_t: torch.Tensor, tile: int) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N], in GEMM calls of exactly `tile` rows (the last
    zero-padded) and, for a big weight, a fixed block of columns: every call of a layer has one
    of a few shapes fixed by the layer, never by M."""
    m, (k, n) = x.shape[0], weight_t.shape
    y = x.new_empty(m, n)
    cols = max(64, COLUMN_BLOCK_BYTES // (k * weight_t.element_size()) // 64 * 64)
    padded = None
    if m % tile:
        padded = x.new_zeros(tile, k)
        padded[:m % tile] = x[m - m % tile:]
    scratch = x.new_empty(tile * min(cols, n))
    for c in range(0, n, cols):
        w = weight_t[:, c:c + cols]
        width = w.shape[1]
        for i in range(0, m, tile):
            rows = min(tile, m - i)
            a = x[i:i + tile] if rows == tile else padded
            if rows == tile and width == n:  # straight into the output rows
                torch.mm(a, w, out=y[i:i + tile])
            else:  # every call writes a contiguous [tile, width] block, as above
                out = scratch[:tile * width].view(tile, width)
                torch.mm(a, w, out=out)
                y[i:i + rows, c:c + width] = out[:rows]
    return y


class Linear(nn.Linear):
    """nn.Linear whose rows do not depend on each other: in an engine step prompt rows and
    generated rows each in tiles of their own size (server/quant/rows.py), elsewhere (the LM
    head's sampling rows, evaluation) in tiles of GENERATED_TILE."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from server.quant.rows import rows_mm

        x2 = x.reshape(-1, self.in_features)
        weight_t = self.weight.t()
        y = rows_mm(self, x2, self._generated_mm, weight_t)
        if y is None:
            y = self._generated_mm(x2)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _generated_mm(self, x2: torch.Tensor) -> torch.Tensor:
        return tiled_mm(x2, self.weight.t(), GENERATED_TILE)
