"""nn.Linear whose rows do not depend on each other (see server/quant/rows.py, tiled_mm)."""

from __future__ import annotations

import torch
from torch import nn

import server.kernels.layer_ops as layer_ops
from server.quant.rows import GENERATED_TILE, RowSplit, rows_mm, tiled_mm


class Linear(nn.Linear):
    """nn.Linear whose rows do not depend on each other. Where this machine's packed bf16
    kernel takes the layer (pack(): AVX-512 BF16; AMX tiles where granted), every row goes
    through it, prompt and generated alike (each row the same instructions: 2-2.5x
    dense_gemm.c at 8-128 rows on Zen 5, ~10x with AMX tiles at 32). Otherwise, in an engine
    step prompt rows and generated rows each through a kernel of their own
    (server/quant/rows.py); generated rows, and every row outside a step (the LM
    head's sampling rows, evaluation), through layer_ops.dense_mm where it takes the layer (it
    reads the weight in place: at one row 5-10x a GEMM in tiles), else in tiles of
    GENERATED_TILE rows. Which one is fixed by the layer's weight and this machine, never by
    the number of rows."""

    packed: torch.Tensor | None = None  # the weight in packed_gemm's layout, once pack()ed

    def pack(self, keep: bool = False) -> None:
        """Take the packed kernel where it serves this layer; the [out, in] weight then goes
        (an empty tensor in its place) unless `keep` (another module shares it: a tied
        embedding)."""
        if self.packed is not None:
            return
        packed = layer_ops.pack_weight(self.weight.detach())
        if packed is None:
            return
        self.packed = packed
        if not keep:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self._packed_mm(x2) if self.packed is not None else None
        if y is None:
            y = rows_mm(self, x2, rows, self._generated_mm, self.weight.t())
        if y is None:
            y = self._generated_mm(x2)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _packed_mm(self, x2: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        y = layer_ops.packed_mm(x2.contiguous(), self.packed, fp32_out=fp32_out)
        if y is None:  # only a caller's wrong dtype or shape comes here
            raise ValueError(f"a packed bf16 layer cannot take {x2.dtype} rows of "
                             f"{x2.shape[-1]}")
        return y

    def _generated_mm(self, x2: torch.Tensor) -> torch.Tensor:
        y = layer_ops.dense_mm(x2.contiguous(), self.weight)
        return y if y is not None else tiled_mm(x2, self.weight.t(), GENERATED_TILE)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """As an LM head: fp32 [N, out], from the kernel's fp32 sums where it has them (the
        packed kernel's or dense_mm's; bf16 logits are 0.06-0.125 apart at a real model's
        magnitudes: near ties became ties), else the bf16 product widened. The choice is the
        layer's, never the number of rows."""
        if self.bias is None and x.dim() == 2:
            if self.packed is not None:
                return self._packed_mm(x, fp32_out=True)
            y = layer_ops.dense_mm(x.contiguous(), self.weight, fp32_out=True)
            if y is not None:
                return y
        return self(x).float()
