"""Matmuls whose every row is computed the same way whatever the other rows of the call.

A GEMM library picks its kernel and blocking by shape: MKL's fp32 GEMM takes another path below
4 rows, oneDNN's bf16 GEMM changes its blocking at 512 rows of a 1536-wide input (measured,
AVX-512 BF16), and AMX machines switch between AMX and AVX-512 kernels. So a row's value would
depend on how many rows share its call: on the batch, the chunking of a prompt, the prefix cache.
`tiled_mm` calls the GEMM with exactly `tile` rows every time (the last call zero-padded), so
every call has one shape and each row's arithmetic depends on its own values only.
"""

from __future__ import annotations

import torch
from torch import nn

DENSE_TILE = 16  # rows per GEMM call of a dense (bf16 or fp32 weight) layer
PROMPT_TILE = 64  # rows per GEMM call of quantized layers' unpacked-weight path (prompt rows)


def tiled_mm(x: torch.Tensor, weight_t: torch.Tensor, tile: int) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N], in GEMM calls of exactly `tile` rows."""
    m = x.shape[0]
    y = x.new_empty(m, weight_t.shape[1])
    full = m - m % tile
    for i in range(0, full, tile):
        torch.mm(x[i:i + tile], weight_t, out=y[i:i + tile])
    if full < m:
        padded = x.new_zeros(tile, x.shape[1])
        padded[:m - full] = x[full:]
        y[full:] = torch.mm(padded, weight_t)[:m - full]
    return y


class Linear(nn.Linear):
    """nn.Linear whose rows do not depend on each other (tiled_mm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = tiled_mm(x2, self.weight.t(), DENSE_TILE).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
