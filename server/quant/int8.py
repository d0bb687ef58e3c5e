"""int8 weight-only quantization: symmetric, one fp scale per output row.

The CPU kernel `_weight_int8pack_mm` takes exactly this layout ([N, K] int8, [N] scales) and is
fast only with bf16 activations (25-60x slower with fp32 ones), so an fp32 model casts to bf16
around it; our kernels (cpu_gemm.py) take fp32 as it is where the machine computes in fp32.
Without the kernel (CUDA, or `use_kernel=False` for exactness tests) the module dequantizes the
weight: the reference path.
"""

from __future__ import annotations

import torch
from torch import nn

import server.kernels.cpu_gemm as cpu_gemm
import server.quant.rows as quant_rows
from server.quant.rows import PACKED_TILE, RowSplit, kernel_rows_independent, rows_mm, tiled_rows


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> ([N, K] int8, [N] fp32 scale) with w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [N]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_int8, in fp32: [N, K]."""
    return q.float() * scale.float()[:, None]


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear whose weight is int8 with per-row scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel_scale: torch.Tensor | None = None  # [N] bf16, set when the kernel applies
        self.tiled = False  # the CPU kernel's rows depend on each other here: call it in tiles
        # On a CPU our kernels serve (cpu_gemm.py): the weight in their layout, and fp32 row scales.
        self.q8: torch.Tensor | None = None
        self.q8_scale: torch.Tensor | None = None

    def prepare(self, use_kernel: bool = True) -> None:
        """Pick the kernel once the module sits on its final device."""
        if self.q8 is not None:
            return  # already converted
        on_cpu = self.weight.device.type == "cpu"
        self.kernel_scale = self.weight_scale.bfloat16() if use_kernel and on_cpu else None
        if self.kernel_scale is not None and cpu_gemm.takes(self.out_features,
                                                               self.in_features):
            # Its own copy; the stored one goes (a tied embedding keeps reading it).
            self.q8, self.q8_scale = cpu_gemm.pack_int8(self.weight), self.weight_scale.float()
            self.weight = None
            return
        self.tiled = self.kernel_scale is not None and not kernel_rows_independent(
            "int8", _sample_int8_kernel(self.in_features), self.in_features)

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # Our kernels take fp32 activations as they are where the machine computes in fp32
        # (avx2_gemm.c: int16 per group, not rounded to bf16), as for int4 layers.
        as_is = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and self.q8 is not None
                                              and cpu_gemm.takes_fp32())
        if (self.q8 is not None and (rows is None or rows.prompt is None) and x.dim() == 2
                and as_is):
            y = self._kernel(x)  # no prompt rows: the short way
            return y if self.bias is None else y + self.bias
        if self.kernel_scale is not None:
            x2 = x.reshape(-1, self.in_features)
            if not as_is or self.unpacked_numel():  # the bf16 GEMM on unpacked weights
                x2 = x2.bfloat16()
            y = rows_mm(self, x2, rows, self._packed_mm)  # prompt rows: bf16 GEMM
            if y is None:
                y = self._packed_mm(x2)
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        w = dequantize_int8(self.weight, self.weight_scale).to(x.dtype)
        return quant_rows.dequantized_linear(x, w, self.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """As an LM head: fp32 [N, out]. our kernels hand them over unrounded (bf16 logits
        are 0.06-0.125 apart at the real model's magnitudes: near ties became exact ties)."""
        if self.q8 is not None and x.dim() == 2 and self.bias is None:
            as_is = x.dtype == torch.float32 and cpu_gemm.takes_fp32()  # fp32 compute, AVX2
            y = cpu_gemm.gemm_int8(x if as_is else x.to(torch.bfloat16), self.q8,
                                   self.q8_scale, out_dtype=torch.float32)
            if y is not None:
                return y
        return self(x).float()

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            return tiled_rows(self._kernel, x2, PACKED_TILE)
        return self._kernel(x2)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None:
            y = cpu_gemm.gemm_int8(x2, self.q8, self.q8_scale, out_dtype=x2.dtype)
            if y is None:
                raise RuntimeError("cpu_gemm declined a layer it was built for")
            return y
        return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.kernel_scale)

    def unpacked_numel(self) -> int:
        """How many bf16 values unpack_into writes (rows.py); 0 without the CPU kernel, and 0 in our
        kernels' layout unless cpu_gemm.PROMPTS_UNPACKED (AMX machines held to avx512_gemm.c): the
        packed kernel takes prompt rows too, faster than a bf16 GEMM on an unpacked copy made each
        step (smollm2-135m:int8, 16 prompts of ~126 tokens: 871-953 against 542-700 tokens/s on Zen
        4, 648-697 against 136-138 on Zen 4 held to AVX2)."""
        if self.kernel_scale is None or (self.q8 is not None and not cpu_gemm.PROMPTS_UNPACKED):
            return 0
        return self.in_features * self.out_features

    def unpack_into(self, flat: torch.Tensor) -> torch.Tensor:
        """The weight times its row scales in bf16 (0.2 ms for 3072x576), as [in, out]: a
        transposed view, which the GEMM takes as it is (3x the kernel's speed at 512 rows)."""
        w = flat[: self.in_features * self.out_features].view(self.out_features, self.in_features)
        if self.q8 is not None:
            cpu_gemm.unpack_int8_into(self.q8, self.kernel_scale, w)
        else:
            torch.mul(self.weight, self.kernel_scale[:, None], out=w)
        return w.t()


def _sample_int8_kernel(num_inputs: int):
    """The int8 kernel on a small random weight of this input width (for the row check)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randint(-127, 128, (64, num_inputs), generator=g, dtype=torch.int8)
    scale = (torch.rand(64, generator=g) / 100).bfloat16()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, weight, scale)


class Int8Embedding(nn.Module):
    """Drop-in for nn.Embedding with int8 rows; a tied LM head can share its buffers."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        shape = (num_embeddings, embedding_dim)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(num_embeddings))
        self.q8: torch.Tensor | None = None  # the tied LM head's cpu_gemm layout, if it has one

    def read_from(self, q8: torch.Tensor) -> None:
        """Look rows up in the LM head's cpu_gemm layout and drop the plain copy."""
        self.q8, self.weight = q8, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[ids] if self.q8 is None else cpu_gemm.int8_rows(self.q8, ids)
        rows = rows.to(self.weight_scale.dtype)  # [..., H]
        return rows * self.weight_scale[ids].unsqueeze(-1)

    def as_linear(self) -> Int8Linear:
        """An LM head reading the same int8 tensor (for tied embeddings)."""
        head = Int8Linear(self.embedding_dim, self.num_embeddings)
        head.weight, head.weight_scale = self.weight, self.weight_scale
        return head
