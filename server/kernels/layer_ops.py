"""The decoder's small per-layer operations in C (layer_ops.c), for CPU tensors.

At decode sizes a PyTorch operator costs a few microseconds whatever it computes, and a layer
ran ~80 of them (RMSNorm 6, rotary embedding 14, the cache writes 4, decode attention ~25):
most of a 135M model's step at one sequence. layer_ops.c does RMSNorm, the rotary embedding with
the cache write, and attention reading the paged pool in place (paged_attention.c): decodes,
and the prompt positions below prompt_positions(), one call each; and dense_mm, an unquantized
layer's generated rows against its weight in place (dense_gemm.c).

The library (SOURCES) is compiled on first use (loader.py) and used only after it passed
`_self_check` on this machine: each function against the PyTorch reference within rounding, and
a batch of rows bit for bit against the same rows computed one at a time (batch invariance).
Otherwise, without a compiler, with LOCALSERVE_NO_NATIVE=1 or for tensors it does not take
(not on the CPU, another dtype, a head wider than 1024), each function returns None and the
caller runs its PyTorch code.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import torch

import server.kernels.layer_checks as layer_checks
import server.kernels.loader as loader

log = logging.getLogger("localserve")

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("layer_ops.c", "paged_attention.c", "dense_gemm.c", "decode_step.c"))
MAX_DIM, MAX_HIDDEN = 1024, 16384  # as in common.h and layer_ops.c
_DTYPES = (torch.float32, torch.bfloat16)
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _I, _I, _D, ctypes.c_int],
    "rope_store": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, ctypes.c_int,
                   ctypes.c_int, _P, _P, _D],
    "paged_decode": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _D, ctypes.c_int,
                     ctypes.c_int],
    "paged_prompt": [_P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _D, ctypes.c_int,
                     ctypes.c_int],
    "dense_gemm": [_P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    "packed_gemm": [_P, _P, _P, _I, _I, _I, ctypes.c_int],
    "packed_gemm_tiles": [ctypes.c_int],
    "act_mul": [_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int],
    "decode_step": [_P, _P, _I],
    "argmax_rows": [_P, _I, _I, _P],
}
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # act_mul's kinds (decode_step.c's ACT_*)

_lib = loader.once(lambda: _open_checked())  # the checked library or None, built once


def enabled() -> bool:
    return _lib() is not None


def _open_checked():
    return loader.checked(SOURCES, "", lambda lib: _self_check(typed(lib)))


def _self_check(lib) -> str | None:
    """None if every function matches PyTorch within rounding and gives each row the same bits
    alone and batched; else what failed (layer_checks.py). packed_gemm takes AMX tiles first
    where int4 layers do (cpu_gemm's kind `amx`), so the check is of the kernel that runs."""
    take_tiles(lib)
    return layer_checks.self_check(sys.modules[__name__], lib)


def take_tiles(lib) -> None:
    """`lib`'s packed_gemm on AMX tiles where int4 layers take them (cpu_gemm's kind `amx`)."""
    import server.kernels.cpu_gemm as cpu_gemm  # (its own library; no cycle)

    lib.packed_gemm_tiles(int(cpu_gemm.KIND == "amx"))


def typed(lib):
    """`lib` (a build of layer_ops.c) with its functions' signatures set."""
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    lib.prompt_positions.restype, lib.prompt_positions.argtypes = ctypes.c_int64, []
    return lib


def _fits(*tensors: torch.Tensor) -> bool:
    """On the CPU, contiguous, and fp32 or bf16 where floating point."""
    for t in tensors:  # a plain loop: this runs several times per layer
        if (t.device.type != "cpu" or not t.is_contiguous()
                or (t.is_floating_point() and t.dtype not in _DTYPES)):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             lib=None) -> torch.Tensor | None:
    """weight * round(x / rms(x)) over the last dim, as RMSNorm computes it; None: not here.
    (`lib`: the library under its load-time check; otherwise the checked one.)"""
    lib = lib or _lib()
    h = x.shape[-1]
    if (lib is None or weight.dtype != x.dtype or x.dtype not in _DTYPES or h > MAX_HIDDEN
            or not x.is_contiguous() or x.device.type != "cpu"):
        return None
    out = torch.empty_like(x)
    if lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps,
                    x.dtype == torch.bfloat16):
        return None
    return out


def rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               lib=None, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | None:
    """From a fused q|k|v projection [T, (Hq + 2 Hkv) * D]: the rotated queries [T, Hq, D],
    the rotated keys and the values written to the caches at `slots`; with q_norm and k_norm
    (RMSNorm weights [D], eps) each q and k head normalized first, as rms_norm would. None: not
    here (nothing written)."""
    lib = lib or _lib()
    t = qkv.shape[0]
    norms = tuple(n for n in (q_norm, k_norm) if n is not None)
    if (lib is None or head_dim > MAX_DIM or head_dim % 2 or k_cache.dtype != v_cache.dtype
            or cos_table.dtype != torch.float32 or positions.dtype != torch.int64
            or slots.dtype != torch.int64 or qkv.stride(-1) != 1
            or not _fits(cos_table, sin_table, positions, slots, k_cache, v_cache, *norms)
            or qkv.device.type != "cpu" or qkv.dtype not in _DTYPES
            or any(n.dtype != qkv.dtype or n.numel() != head_dim for n in norms)):
        return None
    q = qkv.new_empty(t, num_heads, head_dim)
    if lib.rope_store(qkv.data_ptr(), t, qkv.stride(0), num_heads, num_kv_heads, head_dim,
                      cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(),
                      slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      k_cache.shape[1], qkv.dtype == torch.bfloat16,
                      k_cache.dtype == torch.bfloat16,
                      None if q_norm is None else q_norm.data_ptr(),
                      None if k_norm is None else k_norm.data_ptr(), eps):
        return None
    return q


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_slots: torch.Tensor, lens: torch.Tensor, scale: float,
                 lib=None) -> torch.Tensor | None:
    """q [B, Hq, D], one generated token per row, each attending to its first lens[b] positions
    of context_slots [B, max_ctx] in the paged caches -> [B, Hq * D]. None: not here."""
    lib = lib or _lib()
    b, hq, d = q.shape
    if (lib is None or d > MAX_DIM or k_cache.dtype != v_cache.dtype
            or context_slots.dtype != torch.int64 or lens.dtype != torch.int64
            or not _fits(q, k_cache, v_cache, context_slots, lens)):
        return None
    max_ctx = context_slots.shape[1]
    out = q.new_empty(b, hq * d)
    if lib.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        context_slots.data_ptr(), lens.data_ptr(), out.data_ptr(), b, hq,
                        k_cache.shape[0], d, max_ctx,
                        k_cache.shape[1], scale, q.dtype == torch.bfloat16,
                        k_cache.dtype == torch.bfloat16):
        return None
    return out


def prompt_positions() -> int:
    """Prompt positions below this attend through paged_prompt (0: none, without the library)."""
    lib = _lib()
    return lib.prompt_positions() if lib is not None else 0


def paged_prompt(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_slots: torch.Tensor, start: int, scale: float,
                 lib=None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [T, Hq, D]: one sequence's prompt positions [start, start + T), query t attending to
    positions [0, start + t] of context_slots [>= start + T] in the paged caches -> [T, Hq * D]
    (into `out` where given: the step's rows of this chunk). None: not here."""
    lib = lib or _lib()
    t, hq, d = q.shape
    if (lib is None or d > MAX_DIM or k_cache.dtype != v_cache.dtype
            or context_slots.dtype != torch.int64 or context_slots.numel() < start + t
            or not _fits(q, k_cache, v_cache, context_slots)):
        return None
    if out is None:
        out = q.new_empty(t, hq * d)
    elif out.shape != (t, hq * d) or out.dtype != q.dtype or not _fits(out):
        return None
    if lib.paged_prompt(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        context_slots.data_ptr(), start, t, out.data_ptr(), hq,
                        k_cache.shape[0], d, k_cache.shape[1], scale,
                        q.dtype == torch.bfloat16, k_cache.dtype == torch.bfloat16):
        return None
    return out


def dense_mm(x: torch.Tensor, weight: torch.Tensor, lib=None,
             fp32_out: bool = False) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (fp32 with `fp32_out`: logits), each
    row computed on its own (dense_gemm.c: an unquantized layer's generated rows). None: not
    here."""
    lib = lib or _lib()
    if (lib is None or x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]
            or not _fits(x, weight) or x.dtype not in _DTYPES or weight.dtype not in _DTYPES):
        return None
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32 if fp32_out else x.dtype)
    if lib.dense_gemm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k,
                      x.dtype == torch.bfloat16, weight.dtype == torch.bfloat16, fp32_out):
        return None
    return y


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str,
            lib=None) -> torch.Tensor | None:
    """act(gate) * up for rows [T, N] of gate and up (the gated MLP's activation by its config
    name, decode_step.c), each value rounded as PyTorch's act(gate) * up rounds it; the rows
    may be strided (halves of one fused projection). None: not here."""
    lib = lib or _lib()
    kind = ACTIVATIONS.get(activation)
    if (lib is None or kind is None or gate.dim() != 2 or gate.shape != up.shape
            or gate.dtype != up.dtype or gate.dtype not in _DTYPES or gate.stride(1) != 1
            or up.stride(1) != 1 or gate.device.type != "cpu" or up.device.type != "cpu"):
        return None
    (t, n), out = gate.shape, gate.new_empty(gate.shape)
    if lib.act_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), t, n, gate.stride(0),
                   up.stride(0), kind, gate.dtype == torch.bfloat16):
        return None
    return out


def argmax(x: torch.Tensor, lib=None) -> torch.Tensor | None:
    """Each row's index of its greatest value, as x.max(dim=-1).indices (the first of equals; a
    NaN wins) for fp32 [T, N] CPU rows, 2 threads; None: not here."""
    lib = lib or _lib()
    if lib is None or x.dim() != 2 or x.dtype != torch.float32 or not _fits(x):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()):
        return None
    return out


def packs(lib=None) -> bool:
    """Whether unquantized bf16 layers take the packed kernel here (dense_gemm.c's
    packed_gemm: a build for AVX-512 BF16; on AMX CPUs its tiles, where the OS grants them and
    LOCALSERVE_CPU_KERNELS does not hold the machine to another kind: there dense_gemm and
    oneDNN keep them, as before the tiles)."""
    lib = lib or _lib()
    if lib is None or ("amx_tile" in loader.cpu_flags() and not lib.packed_gemm_tiles(-1)):
        return False
    x = torch.zeros(1, 2, dtype=torch.bfloat16)
    return lib.packed_gemm(x.data_ptr(), x.data_ptr(), x.new_empty(16).data_ptr(), 0, 16, 2,
                           0) == 0


def pack_weight(weight: torch.Tensor, lib=None) -> torch.Tensor | None:
    """A bf16 weight [N, K] in packed_gemm's layout, [N / 16][K / 2][16][2]; None where that
    kernel does not take it (see packs; N a multiple of 16, K even)."""
    n, k = weight.shape
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or n % 16 or k % 2
            or not packs(lib)):
        return None
    return weight.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def packed_mm(x: torch.Tensor, packed: torch.Tensor, lib=None,
              fp32_out: bool = False) -> torch.Tensor | None:
    """x [M, K] bf16 @ the packed weight's [N, K]^T -> [M, N] bf16 (fp32 with `fp32_out`),
    each row on its own; None: not here."""
    lib = lib or _lib()
    if lib is None or x.dtype != torch.bfloat16 or not _fits(x) or x.dim() != 2:
        return None
    (m, k), n = x.shape, packed.shape[0] * 16
    if packed.shape[1] * 2 != k:
        return None
    y = torch.empty(m, n, dtype=torch.float32 if fp32_out else x.dtype)
    if lib.packed_gemm(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, fp32_out):
        return None
    return y
