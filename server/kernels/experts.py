"""A mixture of experts' int4 experts in one C call a layer (experts.c), for CPU tensors.

SparseMoE's modules run a step's chosen experts one Python call each: at 32 sequences a
Qwen3-MoE layer chooses most of its experts, and the modules' dozen operators per expert cost
more than the kernels' reads of their weights. `ExpertKernel` hands the step's routing (each
token's experts and weights, computed in the step by the router) and every expert's packed
weights to experts.c, which groups the (token, slot) pairs by expert, runs each chosen expert
once over its rows through this machine's int4 kernel (cpu_gemm.py) and sums each token's
slots in their order.

The library is compiled on first use (loader.py) and used only after `_self_check` passed on
this machine: the layer against the fp32 reference within rounding, and each token's row the
same bits alone as among others. Otherwise (no compiler, no int4 kernel here, experts not all
int4 in our layout, an activation it lacks) SparseMoE runs its modules.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch.nn import functional as F

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.gemm_checks as gemm_checks
import server.kernels.loader as loader

SOURCE = Path(__file__).with_name("experts.c")
MAX_WIDTH = 16384  # as in experts.c
ACTIVATIONS = {"silu": 0, "clamped": 1}  # experts.c's ACT_*
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ARGTYPES = [_P, _C, _P, _P, _I, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _C, _F,
             _F, _C]

# the checked library or None, built once per process
_lib = loader.once(lambda: loader.checked(SOURCE, "", lambda lib: _self_check(typed(lib))))


def typed(lib):
    lib.moe_int4.restype, lib.moe_int4.argtypes = ctypes.c_int, _ARGTYPES
    return lib


def _pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array | None:
    if all(t is None for t in tensors):
        return None
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


class ExpertKernel:
    """One layer's experts for experts.c: their packed weights, biases and activation."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor],
                 gu_bias: list[torch.Tensor | None], down_bias: list[torch.Tensor | None],
                 h: int, inter: int, group: int, activation: str, limit: float = 0.0,
                 alpha: float = 0.0, int8_from: tuple[int, int] | None = None) -> None:
        self.tensors = (gate_up, down, gu_bias, down_bias)  # the pointers' owners
        self.gate_up, self.down = _pointers(gate_up), _pointers(down)
        self.gu_bias, self.down_bias = _pointers(gu_bias), _pointers(down_bias)
        self.num_experts, self.h, self.inter, self.group = len(gate_up), h, inter, group
        self.act, self.limit, self.alpha = ACTIVATIONS[activation], limit, alpha
        self.int8_from = int8_from or (2 * inter, h)
        self.bias_dtype = next((b.dtype for b in gu_bias if b is not None), None)

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 lib=None) -> torch.Tensor | None:
        """x [T, h], experts int64 [T, k] and weights [T, k] (x's dtype) -> [T, h]; None where
        it does not take them."""
        lib, gemm = lib or _lib(), cpu_gemm.checked()
        if (lib is None or gemm is None or x.device.type != "cpu" or x.dim() != 2
                or x.dtype not in (torch.bfloat16, torch.float32) or weights.dtype != x.dtype
                or self.bias_dtype not in (None, x.dtype)):
            return None
        bf16 = x.dtype == torch.bfloat16
        fn = gemm.int4_gemm if bf16 or not cpu_gemm.takes_fp32(gemm) else gemm.int4_gemm_f32
        return self.run(lib, ctypes.cast(fn, ctypes.c_void_p).value, fn is gemm.int4_gemm, x,
                        experts, weights)

    def run(self, lib, gemm: int, gemm_bf16: bool, x: torch.Tensor, experts: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor | None:
        """moe_int4 with the int4 kernel at address `gemm` (bf16 or fp32 rows)."""
        x, experts = x.contiguous(), experts.to(torch.int64).contiguous()
        weights, y = weights.contiguous(), torch.empty_like(x)
        t, k = experts.shape
        failed = lib.moe_int4(
            gemm, gemm_bf16, x.data_ptr(), y.data_ptr(), t, k, experts.data_ptr(),
            weights.data_ptr(), self.num_experts, self.gate_up, self.down, self.gu_bias,
            self.down_bias, self.h, self.inter, self.group, *self.int8_from, self.act,
            self.limit, self.alpha, x.dtype == torch.bfloat16)
        return None if failed else y


def _reference(x, experts, weights, layers, act) -> torch.Tensor:
    """The layer in fp32 from dequantized weights: sum_j w_j down(act(gate_up(x)))."""
    y = torch.zeros(x.shape[0], layers[0][1].shape[0])
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].float(), strict=True):
            gate, up = (x[t].float() @ layers[e][0].t()).chunk(2)
            y[t] += w * (act(gate, up) @ layers[e][1].t())
    return y


def _random_experts(num: int, h: int, inter: int, group: int, g: torch.Generator):
    """(packed, dequantized) [2 * inter, h] and [h, inter] int4 weights of `num` experts."""
    packed, dense = [], []
    for _ in range(num):
        pair = []
        for n, k in ((2 * inter, h), (h, inter)):
            q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            scale = (torch.rand(n, k // group, generator=g) / 8).half()
            zero = (torch.randn(n, k // group, generator=g) / 16).half()
            pair.append((cpu_gemm.pack_int4(q, scale, zero, group),
                         gemm_checks.dequantize_int4(q, scale, zero, group)))
        packed.append([p for p, _ in pair])
        dense.append([d for _, d in pair])
    return packed, dense


def _clamped(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation at limit 0.5 (ClampedExpert.glu)."""
    gate = gate.clamp(max=0.5)
    return (up.clamp(-0.5, 0.5) + 1) * (gate * torch.sigmoid(gate * 1.702))


def _self_check(lib) -> str | None:
    gemm = cpu_gemm.checked()
    if gemm is None:
        return "no int4 kernel on this machine"
    g = torch.Generator().manual_seed(0)
    num, h, inter, group, k, t = 6, 64, 96, 32, 2, 11
    packed, dense = _random_experts(num, h, inter, group, g)
    experts = torch.stack([torch.randperm(num - 1, generator=g)[:k] for _ in range(t)])
    experts[3], experts[7] = torch.tensor([4, 0]), torch.tensor([1, 4])  # 5: chosen by none
    for name, act in (("silu", lambda gate, up: F.silu(gate) * up), ("clamped", _clamped)):
        kernel = ExpertKernel([p[0] for p in packed], [p[1] for p in packed], [None] * num,
                              [None] * num, h, inter, group, name, 0.5, 1.702)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(t, h, generator=g).to(dtype)
            weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
            y = kernel(x, experts, weights, lib)
            if y is None:
                return f"{name} {dtype} declined"
            want = _reference(x, experts, weights, dense, act)
            if not torch.allclose(y.float(), want, rtol=3e-2, atol=3e-2 * want.std()):
                return f"{name} {dtype}"
            if not all(torch.equal(y[i:i + 1], kernel(x[i:i + 1], experts[i:i + 1],
                                                      weights[i:i + 1], lib))
                       for i in range(t)):
                return f"{name} {dtype} rows"
    return None
