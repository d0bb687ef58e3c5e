"""int4 weight-only quantization: asymmetric, one scale and zero point per group of K.

Dequantization is w = (q - 8) * scale + zero with q in [0, 15], the convention of PyTorch's
tinygemm kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int4pack_mm` on CUDA), so the same
stored tensors feed the kernels and the plain reference path. On disk two values share a byte:
the even column in the low nibble, the odd column in the high nibble.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.loader as native
import server.quant.rows as quant_rows
from server.quant.rows import PACKED_TILE, RowSplit, kernel_rows_independent, rows_mm, tiled_rows

SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm kernels accept
KERNEL_DTYPE = torch.bfloat16  # tinygemm's activations, scales and zeros
# Outside an engine step (no row split, see rows.py) a CPU int4 layer with this many rows runs
# the bf16 GEMM on its weight unpacked into a fresh buffer: 2.0 ms instead of 5.5
# at 512 rows for a 3072x576 projection (unpacking 0.15 ms), less at 64 rows already.
UNPACK_MIN_ROWS = 64


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
        # Or, on a CPU our kernels serve (cpu_gemm.py): the weight in their layout.
        self.q4x32: torch.Tensor | None = None
        self.int8_from = out_features  # outputs from here take int8 inputs (cpu_gemm.gemm)
        self.tiled = False  # the CPU kernel's rows depend on each other here: call it in tiles

    def prepare(self, use_kernel: bool = True) -> None:
        """Convert to the device kernel's layout once weights sit on their device.

        Scales and zeros are stored in fp16 (10 mantissa bits; bf16 storage flipped near-tie
        answers of smollm2-135m) and handed to the kernels in bf16: the CPU kernel also takes
        fp16, but ran 12-50x slower here. A model in another dtype casts around the kernel.
        Without a kernel (`use_kernel=False`, for exactness tests) the module dequantizes in
        fp32: the reference path.
        """
        if self.kernel_weight is not None or self.q4x32 is not None:
            return  # already converted (the source buffers are gone)
        device = self.weight.device
        tiles = (cuda_inner_k_tiles(self.out_features, self.in_features, self.group_size)
                 if device.type == "cuda" else None)
        if not use_kernel or not (device.type == "cpu" or tiles):  # CUDA: a shape it takes
            self.kernel_weight = self.scales_and_zeros = None
            return
        q = unpack_int4(self.weight)
        if device.type == "cpu" and cpu_gemm.takes(self.out_features, self.in_features,
                                                      self.group_size):
            self.q4x32 = cpu_gemm.pack_int4(q, self.weight_scale, self.weight_zero,
                                               self.group_size)
            self.weight = self.weight_scale = self.weight_zero = None
            return
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
            checked_unpack()  # build the helper while loading, not in the first request
            self.tiled = not kernel_rows_independent(
                f"int4-g{self.group_size}", _sample_int4_kernel(self.in_features,
                                                                self.group_size),
                self.in_features)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_int4_kernel(q), tiles)
        self.kernel_weight = packed
        self.scales_and_zeros = torch.stack(
            (self.weight_scale.t(), self.weight_zero.t()), dim=-1
        ).to(KERNEL_DTYPE).contiguous()
        # The kernel layout is all the forward needs: keeping the stored layout too would
        # double the int4 weights in memory.
        self.weight = self.weight_scale = self.weight_zero = None

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # Our kernels take fp32 activations as they are where they compute in fp32 (avx2_gemm.c),
        # so rows that take the kernel are never rounded to bf16, AMX machines included.
        as_is = x.dtype == KERNEL_DTYPE or (x.dtype == torch.float32 and cpu_gemm.takes_fp32())
        kernel_rows = not cpu_gemm.PROMPTS_UNPACKED or (
            rows.prompt is None if rows is not None else x.shape[0] < UNPACK_MIN_ROWS)
        if self.q4x32 is not None and x.dim() == 2 and as_is and kernel_rows:
            y = self._q4x32_rows(x, rows)  # no dtype to cast: the short way
            return y if self.bias is None else y + self.bias
        if self.kernel_weight is not None or self.q4x32 is not None:
            x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
            if x.device.type == "cpu":
                y = self._cpu_mm(x2, rows)
            else:
                y = torch.ops.aten._weight_int4pack_mm(
                    x2, self.kernel_weight, self.group_size, self.scales_and_zeros
                )
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        w = dequantize_int4(
            unpack_int4(self.weight), self.weight_scale, self.weight_zero, self.group_size
        )
        return quant_rows.dequantized_linear(x, w.to(x.dtype), self.bias)

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            return tiled_rows(self._kernel, x2, PACKED_TILE)
        return self._kernel(x2)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        if self.q4x32 is not None:
            y = cpu_gemm.gemm(x2, self.q4x32, self.group_size, int8_from=self.int8_from)
            if y is not None:
                return y
            raise RuntimeError("cpu_gemm declined a layer it was built for")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.kernel_weight, self.group_size, self.scales_and_zeros)

    def _q4x32_rows(self, x2: torch.Tensor, rows: RowSplit | None) -> torch.Tensor:
        """Our CPU kernel's rows: in an engine step, where the machine has a kernel for prompt
        rows (cpu_gemm.prompt_path: AMX tiles on the weight dequantized to bf16), prompt rows
        take that and generated rows this layer's kernel; else every row the layer's kernel."""
        if rows is None or rows.prompt is None or not cpu_gemm.prompt_path():
            return self._kernel(x2)
        return rows_mm(self, x2, rows, self._kernel, prompt_mm=self._prompt_kernel)

    def _prompt_kernel(self, x2: torch.Tensor) -> torch.Tensor:
        y = cpu_gemm.gemm_prompt(x2, self.q4x32, self.group_size)
        if y is None:
            raise RuntimeError("cpu_gemm declined a layer's prompt rows it was built for")
        return y

    def _cpu_mm(self, x2: torch.Tensor, rows: RowSplit | None) -> torch.Tensor:
        prompt_mm = (self._prompt_kernel if self.q4x32 is not None and cpu_gemm.prompt_path()
                     else None)
        y = rows_mm(self, x2, rows, self._packed_mm, prompt_mm=prompt_mm)
        if y is not None:
            return y
        if (x2.shape[0] >= UNPACK_MIN_ROWS and self.unpacked_numel()
                and (weight_t := self.unpacked_t()) is not None):
            return torch.mm(x2, weight_t)
        return self._packed_mm(x2)

    def unpacked_numel(self) -> int:
        """How many bf16 values unpack_into writes (rows.py); 0 when it cannot."""
        if self.q4x32 is not None:
            can = cpu_gemm.PROMPTS_UNPACKED
        else:
            can = (self.kernel_weight is not None and self.kernel_weight.device.type == "cpu"
                   and self._unpacker() is not None)
        return self.out_features * self.in_features if can else 0

    def _unpacker(self):
        """The checked helper if it takes this layer's shape, else None."""
        n, k = self.out_features, self.in_features
        if n % 64 or self.kernel_weight.shape != (n, k // 2):  # 64: either layout's blocks
            return None
        return checked_unpack()

    def unpack_into(self, flat: torch.Tensor) -> torch.Tensor | None:
        n, k = self.out_features, self.in_features
        return self.unpacked_t(flat[: n * k].view(k, n))

    def unpacked_t(self, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The CPU kernel's weight as bf16 [in, out] in `out` (default: a new tensor); None
        without the compiled helper or for shapes it does not take."""
        n, k = self.out_features, self.in_features
        if out is None:
            out = torch.empty(k, n, dtype=KERNEL_DTYPE)
        if self.q4x32 is not None:
            return cpu_gemm.unpack_t(self.q4x32, self.group_size, out)
        unpack = self._unpacker()
        if unpack is None:
            return None
        if unpack(self.kernel_weight.data_ptr(), self.scales_and_zeros.data_ptr(),
                  out.data_ptr(), n, k, self.group_size, 0, k):
            return None
        return out


def _random_cpu_int4(n: int, k: int, group: int, seed: int):
    """A random int4 weight [n, k] in the CPU kernel's layout: (q, scale, zero, packed,
    scales_and_zeros), for the load-time checks below."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k // group, generator=g) / 8).to(KERNEL_DTYPE)
    zero = torch.randn(n, k // group, generator=g).to(KERNEL_DTYPE)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return q, scale, zero, packed, torch.stack((scale.t(), zero.t()), dim=-1).contiguous()


def _sample_int4_kernel(num_inputs: int, group_size: int):
    """The CPU int4 kernel on a small random weight of this input width (for the row check)."""
    *_, packed, scales_and_zeros = _random_cpu_int4(64, num_inputs, group_size, seed=1)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size,
                                                                scales_and_zeros)


_checked: list = []


def checked_unpack():
    """The compiled unpack helper, (packed, scales_zeros, out, n, k, group, k0, k1) -> 0 on
    success, once it has reproduced this PyTorch's own packing on a test matrix with one of the
    block sizes it knows (the CPU pack layout is PyTorch's internal business: 64 outputs a block
    where it runs AVX-512 kernels, 32 with AVX2 ones; if a release changes it, the helper is not
    used); None otherwise."""
    if not _checked:
        fn, unpack = native.int4_unpack(), None
        if fn is not None:
            n, k, group = 128, 64, 32
            q, scale, zero, packed, sz = _random_cpu_int4(n, k, group, seed=0)
            want = dequantize_int4(q, scale, zero, group).to(KERNEL_DTYPE).t()
            for block in (64, 32):
                out = torch.empty(k, n, dtype=KERNEL_DTYPE)
                if (packed.shape == (n, k // 2) and not fn(packed.data_ptr(), sz.data_ptr(),
                                                           out.data_ptr(), n, k, group, 0, k,
                                                           block)
                        and torch.equal(out, want)):
                    unpack = functools.partial(_unpack_blocks, fn, block)
                    break
        _checked.append(unpack)
    return _checked[0]


def _unpack_blocks(fn, block: int, *args: int) -> int:
    return fn(*args, block)


def cuda_inner_k_tiles(n: int, k: int, group_size: int) -> int | None:
    """How many 16-wide K tiles CUDA tinygemm packs in a word for an [n, k] weight, or None for a
    shape it cannot take (such a layer dequantizes its weight each call instead). The kernel wants
    K a multiple of 16 x tiles (8, 4 or 2): smollm2-135m's hidden size 576 takes 4, not the 8 its
    MLP's 1536 takes. N is padded to tiles of 8 that its scales must match."""
    if n % 8 or group_size not in SUPPORTED_GROUP_SIZES:
        return None
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def pack_int4_kernel(q: torch.Tensor) -> torch.Tensor:
    """CUDA tinygemm's input: [N, K/2] uint8 with the even column in the high nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]
