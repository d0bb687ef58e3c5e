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
from pathlib import Path

import torch

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
    "act_mul": [_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int],
    "decode_step": [_P, _P, _I],
}
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # act_mul's kinds (decode_step.c's ACT_*)

_lib = loader.once(lambda: _open_checked())  # the checked library or None, built once


def enabled() -> bool:
    return _lib() is not None


def _open_checked():
    return loader.checked(SOURCES, "", lambda lib: _self_check(typed(lib)))


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
                 lib=None) -> torch.Tensor | None:
    """q [T, Hq, D]: one sequence's prompt positions [start, start + T), query t attending to
    positions [0, start + t] of context_slots [>= start + T] in the paged caches -> [T, Hq * D].
    None: not here."""
    lib = lib or _lib()
    t, hq, d = q.shape
    if (lib is None or d > MAX_DIM or k_cache.dtype != v_cache.dtype
            or context_slots.dtype != torch.int64 or context_slots.numel() < start + t
            or not _fits(q, k_cache, v_cache, context_slots)):
        return None
    out = q.new_empty(t, hq * d)
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


def packs(lib=None) -> bool:
    """Whether unquantized bf16 layers take the packed kernel here (dense_gemm.c's
    packed_gemm: a build for AVX-512 BF16). Not on AMX CPUs, whose prompt rows oneDNN's AMX
    GEMM serves (their speed against this kernel not measured yet)."""
    lib = lib or _lib()
    if lib is None or "amx_tile" in loader.cpu_flags():
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


def _self_check(lib) -> str | None:
    """None if every function matches PyTorch within rounding and gives each row the same bits
    alone and batched; else what failed."""
    g = torch.Generator().manual_seed(0)
    for dtype in _DTYPES:
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        x = torch.randn(9, 576, generator=g).to(dtype)
        w = (torch.rand(576, generator=g) + 0.5).to(dtype)
        got = rms_norm(x, w, 1e-5, lib)
        h = x.float()
        want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        if got is None or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            return f"rms_norm {dtype}"
        if not torch.equal(got[3:4], rms_norm(x[3:4].contiguous(), w, 1e-5, lib)):
            return f"rms_norm rows {dtype}"
        problem = (_check_attention(lib, dtype, tol, g) or _check_dense(lib, dtype, tol, g)
                   or _check_act(lib, dtype, tol, g))
        if problem:
            return problem
    return _check_packed(lib, g)


def _check_dense(lib, dtype: torch.dtype, tol: float, g: torch.Generator) -> str | None:
    """dense_mm against the fp32 product (weights in the compute dtype and in bf16), and each
    row alone the same bits as in a batch."""
    x = torch.randn(11, 96, generator=g).to(dtype)
    for wdtype in {dtype, torch.bfloat16}:
        w = torch.randn(48, 96, generator=g).to(wdtype)
        got, want = dense_mm(x, w, lib), x.float() @ w.float().t()
        if got is None or not torch.allclose(got.float(), want, rtol=tol, atol=tol * 10):
            return f"dense_mm {dtype} x {wdtype}"
        if not all(torch.equal(got[i:i + 1], dense_mm(x[i:i + 1], w, lib)) for i in range(11)):
            return f"dense_mm rows {dtype} x {wdtype}"
        wide = dense_mm(x, w, lib, fp32_out=True)  # the same sums, rounded only to fp32
        if wide is None or not torch.equal(wide.to(dtype), got):
            return f"dense_mm fp32 out {dtype} x {wdtype}"
    return None


def _check_act(lib, dtype: torch.dtype, tol: float, g: torch.Generator) -> str | None:
    """act_mul against PyTorch's act(gate) * up on the halves of fused rows (values to +-12,
    where the exponentials saturate), each row alone the same bits as in the batch."""
    torch_acts = {"silu": torch.nn.functional.silu,
                  "gelu_pytorch_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}
    fused = (torch.randn(7, 2 * 300, generator=g) * 4).clamp(-12, 12).to(dtype)
    gate, up = fused.chunk(2, dim=-1)
    for name, act in torch_acts.items():
        got, want = act_mul(gate, up, name, lib), act(gate.float()) * up.float()
        if got is None or not torch.allclose(got.float(), want, rtol=tol, atol=tol):
            return f"act_mul {name} {dtype}"
        if not torch.equal(got[4:5], act_mul(gate[4:5], up[4:5], name, lib)):
            return f"act_mul rows {name} {dtype}"
    return None


def _check_packed(lib, g: torch.Generator) -> str | None:
    """packed_mm against the fp32 product where this build has it, 80 outputs (a pass of 48,
    one of 32) and 11 rows (a pass of 8, one of 3): each row alone the same bits as in the
    batch, and bf16 outputs its fp32 ones rounded."""
    w = torch.randn(80, 96, generator=g).bfloat16()
    packed = pack_weight(w, lib)
    if packed is None:
        return None
    x = torch.randn(11, 96, generator=g).bfloat16()
    got, want = packed_mm(x, packed, lib, fp32_out=True), x.float() @ w.float().t()
    if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
        return "packed_mm"
    if not all(torch.equal(got[i:i + 1], packed_mm(x[i:i + 1], packed, lib, fp32_out=True))
               for i in range(11)):
        return "packed_mm rows"
    if not torch.equal(packed_mm(x, packed, lib), got.bfloat16()):
        return "packed_mm bf16 out"
    return None


def _check_attention(lib, dtype: torch.dtype, tol: float, g: torch.Generator) -> str | None:
    hq, hkv, d, slots, t = 6, 2, 64, 97, 5
    positions = torch.tensor([3, 0, 40, 7, 95])
    where = torch.randperm(slots - 1, generator=g)[:t]
    angles = torch.outer(torch.arange(128.0), torch.rand(d // 2, generator=g))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    caches = [torch.randn(hkv, slots, d, generator=g).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    q = rope_store(qkv, hq, hkv, d, cos, sin, positions, where, *caches, lib=lib)
    x = qkv.float().view(t, hq + 2 * hkv, d)
    c, s = cos[positions][:, None], sin[positions][:, None]
    rotated = x * c + torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * s
    before[0][:, where] = rotated[:, hq:hq + hkv].transpose(0, 1).to(dtype)
    before[1][:, where] = x[:, hq + hkv:].transpose(0, 1).to(dtype)
    if (q is None or not torch.allclose(q.float(), rotated[:, :hq], rtol=tol, atol=tol)
            or not all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
                       for a, b in zip(caches, before, strict=True))):
        return f"rope_store {dtype}"
    problem = _check_normed_rope(lib, qkv, hq, hkv, cos, sin, positions, where, g)
    if problem:
        return problem
    lens = torch.tensor([1, 50, 96, 17])
    ctx = torch.stack([torch.randperm(slots - 1, generator=g) for _ in lens])
    qd = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    got = paged_decode(qd, *caches, ctx, lens, d**-0.5, lib)
    if got is None:
        return f"paged_decode {dtype}"
    for i, n in enumerate(lens.tolist()):
        k, v = (c[:, ctx[i, :n]].float().repeat_interleave(hq // hkv, 0) for c in caches)
        p = torch.softmax(qd[i].float()[:, None] @ k.transpose(1, 2) * d**-0.5, dim=-1)
        want = (p @ v).reshape(-1)
        alone = paged_decode(qd[i:i + 1].contiguous(), *caches, ctx[i:i + 1].contiguous(),
                             lens[i:i + 1].contiguous(), d**-0.5, lib)
        if (not torch.allclose(got[i].float(), want, rtol=tol, atol=tol)
                or alone is None or not torch.equal(alone[0], got[i])):
            return f"paged_decode {dtype} row {i}"
    return _check_prompt(lib, dtype, tol, caches, ctx[2], g)


def _check_normed_rope(lib, qkv, hq, hkv, cos, sin, positions, slots, g) -> str | None:
    """rope_store with q/k norms: the bits of rms_norm on each q and k head, then rope_store."""
    t, d, dtype = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv), qkv.dtype
    qn, kn = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    heads = qkv.view(t, hq + 2 * hkv, d)
    normed = torch.cat([rms_norm(heads[:, :hq].reshape(-1, d), qn, 1e-6, lib).view(t, hq, d),
                        rms_norm(heads[:, hq:hq + hkv].reshape(-1, d), kn, 1e-6, lib).view(
                            t, hkv, d), heads[:, hq + hkv:]], dim=1).reshape(t, -1)
    caches = [[torch.zeros(hkv, 97, d, dtype=dtype) for _ in range(2)] for _ in range(2)]
    fused = rope_store(qkv, hq, hkv, d, cos, sin, positions, slots, *caches[0], lib=lib,
                       q_norm=qn, k_norm=kn, eps=1e-6)
    apart = rope_store(normed, hq, hkv, d, cos, sin, positions, slots, *caches[1], lib=lib)
    if (fused is None or apart is None or not torch.equal(fused, apart)
            or not all(torch.equal(a, b) for a, b in zip(*caches, strict=True))):
        return f"rope_store with q/k norms {dtype}"
    return None


def _check_prompt(lib, dtype: torch.dtype, tol: float, caches: list[torch.Tensor],
                  slots: torch.Tensor, g: torch.Generator) -> str | None:
    """paged_prompt against PyTorch's causal attention, and a chunk alone the same bits as the
    same rows computed with the whole prompt (positions 0..40, the chunk 23..40)."""
    hkv, d = caches[0].shape[0], caches[0].shape[2]
    for hq in (hkv * 3, hkv):  # query groups of 3 (SmolLM2) and 1 (multi-head)
        qp = torch.randn(41, hq, d, generator=g).to(dtype)
        whole = paged_prompt(qp, *caches, slots, 0, d**-0.5, lib)
        part = paged_prompt(qp[23:].contiguous(), *caches, slots, 23, d**-0.5, lib)
        if whole is None or part is None or not torch.equal(part, whole[23:]):
            return f"paged_prompt {dtype} chunk"
        k, v = (c[:, slots[:41]].float().repeat_interleave(hq // hkv, 0) for c in caches)
        s = qp.float().transpose(0, 1) @ k.transpose(1, 2) * d**-0.5  # [hq, 41, 41]
        s += torch.full((41, 41), float("-inf")).triu(1)
        want = (torch.softmax(s, dim=-1) @ v).transpose(0, 1).reshape(41, -1)
        if not torch.allclose(whole.float(), want, rtol=tol, atol=tol):
            return f"paged_prompt {dtype}"
    return None
