"""tiled_mm: a row's product is the same bit for bit whatever the number of rows beside it, at
the real model's shapes (kernels switch by shape: MKL's fp32 GEMM below 4 rows, oneDNN's bf16
GEMM at 512 rows of a 1536-wide input), for weights in one block and in column blocks."""

from __future__ import annotations

import pytest
import torch

from server.quant.rows import GENERATED_TILE, PROMPT_TILE, tiled_mm

SHAPES = [(576, 960), (1536, 576), (576, 49152)]  # q/k/v, down, the LM head (column blocks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_each_row_is_independent_of_the_others(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    weight_t = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).t()  # a transposed view
    x = torch.randn(600, k, generator=g).to(dtype)
    for tile in (GENERATED_TILE, PROMPT_TILE):
        rows = (1, 3, 600) if n < 10_000 else (1, 5, 40)
        alone = torch.cat([tiled_mm(x[i:i + 1], weight_t, tile) for i in range(rows[-1])])
        for m in rows:
            assert torch.equal(tiled_mm(x[:m], weight_t, tile), alone[:m])
        # Shifted by one row: each row sits elsewhere in its tile, among other rows.
        assert torch.equal(tiled_mm(x[1:rows[-1]], weight_t, tile), alone[1:])
    ref = x[:40].float() @ weight_t.float()
    torch.testing.assert_close(tiled_mm(x[:40], weight_t, 16).float(), ref, rtol=2e-2,
                               atol=2e-2)
