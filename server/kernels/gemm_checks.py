"""cpu_gemm's load-time check (cpu_gemm._self_check): each kernel of a built library against
the fp32 reference within rounding, its rows the same alone and batched, and its unpacking to
bf16 bit for bit the reference dequantization. A library that fails is not used."""

from __future__ import annotations

import torch


def dequantize_int4(q, scale, zero, group: int) -> torch.Tensor:
    """(q - 8) * scale + zero in fp32, [N, K] (int4.dequantize_int4's arithmetic)."""
    n, k = q.shape
    g = q.float().reshape(n, k // group, group) - 8.0
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def self_check(cg, lib) -> str | None:
    """None if `lib` (a kind's library, typed) computes as its reference says through the
    cpu_gemm module `cg`'s wrappers, each row the same alone and batched; else what failed."""
    g = torch.Generator().manual_seed(0)
    for n, k, group in ((96, 256, 32), (64, 384, 128)):
        problem = _check_int4(cg, lib, n, k, group, g)
        if problem:
            return problem
    return _check_int8(cg, lib, g)


def _check_int4(cg, lib, n: int, k: int, group: int, g: torch.Generator) -> str | None:
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) / 8).half()
    zero = (torch.randn(n, k // group, generator=g) / 4).half()
    layout = cg.pack_int4(q, scale, zero, group)
    w = dequantize_int4(q, scale, zero, group)  # fp32 [N, K]
    unpacked = cg.unpack_t(layout, group, torch.empty(k, n, dtype=torch.bfloat16), lib)
    if unpacked is None or not torch.equal(unpacked, w.to(torch.bfloat16).t()):
        return "unpack"
    x = torch.randn(37, k, generator=g).to(torch.bfloat16)  # amx_gemm.c: 3 row tiles
    y = cg.gemm(x, layout, group, lib)
    want = x.float() @ w.t()
    if y is None or not torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2 * want.std()):
        return "gemm"
    if not all(torch.equal(y[i:i + 1], cg.gemm(x[i:i + 1], layout, group, lib))
               for i in range(37)):
        return "rows"
    if cg.prompt_path(lib):  # the bf16 weights' products, each row alone or in any call
        yp = cg.gemm_prompt(x, layout, group, lib)
        exact = x.float() @ unpacked.float()
        if yp is None or not torch.allclose(yp.float(), exact, rtol=1e-2,
                                            atol=1e-2 * exact.std()):
            return "prompt gemm"
        if not all(torch.equal(yp[i:i + 1], cg.gemm_prompt(x[i:i + 1], layout, group, lib))
                   for i in range(37)) or not torch.equal(
                       yp[3:20], cg.gemm_prompt(x[3:20], layout, group, lib)):
            return "prompt rows"
    if group == 32 and cg.int8_path(lib):  # the outputs from 32 on with int8 inputs
        xk = x.float() if cg.takes_fp32(lib) else x
        y8, y16 = cg.gemm(xk, layout, group, lib, 32), cg.gemm(xk, layout, group, lib)
        if y8 is None or not torch.equal(y8[:, :32], y16[:, :32]) or not torch.allclose(
                y8.float(), want, rtol=2e-2, atol=2e-2 * want.std()):
            return "int8 inputs"
        if not all(torch.equal(y8[i:i + 1], cg.gemm(xk[i:i + 1], layout, group, lib, 32))
                   for i in range(37)):
            return "int8 input rows"
    return None


def _check_int8(cg, lib, g: torch.Generator) -> str | None:
    q = torch.randint(-127, 128, (96, 320), generator=g, dtype=torch.int8)
    scale = torch.rand(96, generator=g) / 100
    layout = cg.pack_int8(q)
    unpacked = torch.empty(96, 320, dtype=torch.bfloat16)
    cg.unpack_int8_into(layout, scale.bfloat16(), unpacked)
    if not torch.equal(unpacked, (q.bfloat16() * scale.bfloat16()[:, None])):
        return "int8 unpack"
    x = torch.randn(37, 320, generator=g).to(torch.bfloat16)
    y = cg.gemm_int8(x, layout, scale, lib)
    want = x.float() @ (q.float() * scale[:, None]).t()
    if y is None or not torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2 * want.std()):
        return "int8 gemm"
    if not all(torch.equal(y[i:i + 1], cg.gemm_int8(x[i:i + 1], layout, scale, lib))
               for i in range(37)):
        return "int8 rows"
    return None
