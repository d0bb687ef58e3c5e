"""What the kernel tests share: the kinds of our CPU kernels this machine runs."""

from __future__ import annotations

import pytest

from server.kernels.loader import cpu_flags, cpu_vendor

FLAGS = cpu_flags()
# The kernels this CPU can run, its first pick first (an AMX machine runs avx512_gemm.c and
# avx2_gemm.c too, so each kind it has is tested wherever CI runs).
KERNEL_KINDS = [k for k, need in (
    ("amx", {"avx512_bf16", "avx512bw", "amx_bf16", "amx_tile"}),
    ("avx512_bf16", {"avx512_bf16", "avx512bw"}),
    ("avx2", {"avx2", "fma", "f16c"})) if need <= FLAGS]
if KERNEL_KINDS[-2:] == ["avx512_bf16", "avx2"] and cpu_vendor() == "GenuineIntel" and \
        "avx512_vnni" in FLAGS:
    KERNEL_KINDS[-2:] = ["avx2", "avx512_bf16"]  # Intel: the VNNI path before vdpbf16ps


@pytest.fixture(params=KERNEL_KINDS)
def kernel_kind(request, monkeypatch):
    """Each of our kernel libraries this CPU runs, as the one layers use."""
    from server.kernels import cpu_gemm

    lib = cpu_gemm.of_kind(request.param)
    assert lib is not None  # built and checked on this CPU
    monkeypatch.setattr(cpu_gemm, "_state", [lib])
    return request.param
