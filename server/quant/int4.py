"""int4 weight-only quantization: asymmetric, one scale and zero point per group of K.

Dequantization is w = (q - 8) * scale + zero with q in [0, 15], the convention of PyTorch's
tinygemm kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int4pack_mm` on CUDA), so the same
stored tensors feed the kernels and the plain reference path. On disk two values share a byte:
the even column in the low nibble, the odd column in the high nibble.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm kernels accept
KERNEL_DTYPE = torch.bfloat16  # tinygemm's activations, scales and zeros


def quantize_int4(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] uint8 in 0..15, scale [N, K/g] fp16, zero [N, K/g] fp16)."""
    n, k = w.shape
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {SUPPORTED_GROUP_SIZES}")
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, K/g]
    # Round scale and zero to their stored fp16 first so q is chosen against those values.
    scale = ((hi - lo) / 15.0).clamp(min=1e-6).to(torch.float16)
    zero = (lo + 8.0 * scale.float()).to(torch.float16)
    base = zero.float() - 8.0 * scale.float()  # the value of q = 0
    q = torch.round((g - base[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scale, zero


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Inverse of quantize_int4, in fp32: [N, K]."""
    n, k = q.shape
    g = q.float().reshape(n, k // group_size, group_size) - 8.0
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in 0..15 -> [N, K/2] uint8."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 values in 0..15."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1)


class Int4Linear(nn.Module):
    """Drop-in for nn.Linear with a group-wise int4 weight."""

    def __init__(
        self, in_features: int, out_features: int, group_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer(
            "weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, groups))
        self.register_buffer("weight_zero", torch.empty(out_features, groups))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel_weight: torch.Tensor | None = None  # tinygemm layout, when a kernel applies
        self.scales_and_zeros: torch.Tensor | None = None  # [K/g, N, 2] in KERNEL_DTYPE

    def prepare(self, use_kernel: bool = True) -> None:
        """Convert to the device kernel's layout once weights sit on their device.

        Scales and zeros are stored in fp16 (10 mantissa bits; bf16 storage flipped near-tie
        answers of smollm2-135m) and handed to the kernels in bf16: the CPU kernel also takes
        fp16, but ran 12-50x slower here. A model in another dtype casts around the kernel.
        Without a kernel (`use_kernel=False`, for exactness tests) the module dequantizes in
        fp32: the reference path.
        """
        if self.kernel_weight is not None:
            return  # already converted (the source buffers are gone)
        device = self.weight.device
        if not use_kernel or device.type not in ("cpu", "cuda"):
            self.kernel_weight = self.scales_and_zeros = None
            return
        q = unpack_int4(self.weight)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_int4_kernel(q), 8)
        self.kernel_weight = packed
        self.scales_and_zeros = torch.stack(
            (self.weight_scale.t(), self.weight_zero.t()), dim=-1
        ).to(KERNEL_DTYPE).contiguous()
        # The kernel layout is all the forward needs: keeping the stored layout too would
        # double the int4 weights in memory.
        self.weight = self.weight_scale = self.weight_zero = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is not None:
            x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
            if x.device.type == "cpu":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x2, self.kernel_weight, self.group_size, self.scales_and_zeros
                )
            else:
                y = torch.ops.aten._weight_int4pack_mm(
                    x2, self.kernel_weight, self.group_size, self.scales_and_zeros
                )
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        w = dequantize_int4(
            unpack_int4(self.weight), self.weight_scale, self.weight_zero, self.group_size
        )
        return F.linear(x, w.to(x.dtype), self.bias)


def pack_int4_kernel(q: torch.Tensor) -> torch.Tensor:
    """CUDA tinygemm's input: [N, K/2] uint8 with the even column in the high nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]
